"""EfficientNet-Lite0, the frozen image encoder of `kvyard graft vision` (#40), read from its released weights.

The file is the legacy torch pickle of the `efficientnet_pytorch` family (`_conv_stem`, `_blocks.N`, `_conv_head`,
`_fc`), read with `weights_only=True`: no code from it runs. The network is written here, layer names matching
the file's: a 3x3 stride-2 stem, 16 inverted-residual blocks (1x1 expand, depthwise kxk, 1x1 project; no
squeeze-excitation in the Lite models), a 1x1 head to 1,280 channels, ReLU6 throughout, batch norms with
eps 1e-3, and TensorFlow's "same" padding (an odd total pad goes to the right and bottom). `features` gives the
head's 1,280 channels per spatial position, the grid a projector maps to soft tokens.
"""

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from kvyard.errors import CheckpointError

BN_EPS = 1e-3
# (repeats, kernel, stride, expansion, in, out) per stage: efficientnet_lite_builder's lite0 (width 1, depth 1)
STAGES = [(1, 3, 1, 1, 32, 16), (2, 3, 2, 6, 16, 24), (2, 5, 2, 6, 24, 40), (3, 3, 2, 6, 40, 80),
          (3, 5, 1, 6, 80, 112), (4, 5, 2, 6, 112, 192), (1, 3, 1, 6, 192, 320)]
HEAD_CHANNELS = 1280
# ImageNet's channel means and deviations: the inputs the weights were trained on
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class SameConv(nn.Conv2d):
    """A bias-free conv with TensorFlow's "same" padding, worked out for each input size."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pads = []
        for size, k, s in zip(reversed(x.shape[-2:]), reversed(self.kernel_size), reversed(self.stride), strict=True):
            total = max((math.ceil(size / s) - 1) * s + k - size, 0)
            pads += [total // 2, total - total // 2]
        return F.conv2d(F.pad(x, pads), self.weight, None, self.stride, 0, 1, self.groups)


def _conv(cin: int, cout: int, k: int = 1, stride: int = 1, groups: int = 1) -> SameConv:
    return SameConv(cin, cout, k, stride=stride, groups=groups, bias=False)


def _bn(channels: int) -> nn.BatchNorm2d:
    return nn.BatchNorm2d(channels, eps=BN_EPS)


@dataclass(frozen=True)
class BlockShape:
    kernel: int
    stride: int
    expansion: int
    cin: int
    cout: int


class MBConv(nn.Module):
    def __init__(self, b: BlockShape):
        super().__init__()
        mid = b.cin * b.expansion
        self.shape = b
        if b.expansion != 1:
            self._expand_conv, self._bn0 = _conv(b.cin, mid), _bn(mid)
        self._depthwise_conv, self._bn1 = _conv(mid, mid, b.kernel, b.stride, groups=mid), _bn(mid)
        self._project_conv, self._bn2 = _conv(mid, b.cout), _bn(b.cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu6(self._bn0(self._expand_conv(x))) if self.shape.expansion != 1 else x
        h = self._bn2(self._project_conv(F.relu6(self._bn1(self._depthwise_conv(h)))))
        return h + x if self.shape.stride == 1 and self.shape.cin == self.shape.cout else h


class EfficientNetLite0(nn.Module):
    def __init__(self, num_classes: int = 1000):
        super().__init__()
        self._conv_stem, self._bn0 = _conv(3, 32, 3, 2), _bn(32)
        shapes = [BlockShape(k, s if i == 0 else 1, e, cin if i == 0 else cout, cout)
                  for repeats, k, s, e, cin, cout in STAGES for i in range(repeats)]
        self._blocks = nn.ModuleList(MBConv(b) for b in shapes)
        self._conv_head, self._bn1 = _conv(STAGES[-1][-1], HEAD_CHANNELS), _bn(HEAD_CHANNELS)
        self._fc = nn.Linear(HEAD_CHANNELS, num_classes)

    def features(self, pixels: torch.Tensor) -> torch.Tensor:
        """[batch, 3, H, W] normalised pixels -> [batch, 1280, H/32, W/32] (rounded up)."""
        x = F.relu6(self._bn0(self._conv_stem(pixels)))
        for block in self._blocks:
            x = block(x)
        return F.relu6(self._bn1(self._conv_head(x)))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """ImageNet logits (the classifier the weights came with)."""
        return self._fc(self.features(pixels).mean((2, 3)))


def normalise(images: torch.Tensor) -> torch.Tensor:
    """[batch, 3, H, W] RGB in [0, 1] -> the network's inputs."""
    return (images - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)


def load_encoder(path: str | Path) -> EfficientNetLite0:
    """The encoder with the file's weights, in eval mode and frozen; a file that is not them is named."""
    p = Path(path)
    try:
        state = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file gets one clear error naming it
        raise CheckpointError(f"{p}: not a readable EfficientNet-Lite0 weights file ({type(e).__name__}: {e})") from e
    if not isinstance(state, dict):
        raise CheckpointError(f"{p}: expected a dict of tensors, found {type(state).__name__}")
    state = {k: v for k, v in state.items() if not k.endswith("num_batches_tracked")}
    model = EfficientNetLite0()
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise CheckpointError(f"{p}: not EfficientNet-Lite0's weights: {str(e).splitlines()[0]} "
                              f"{str(e).splitlines()[1].strip() if len(str(e).splitlines()) > 1 else ''}") from e
    return model.eval().requires_grad_(False)
