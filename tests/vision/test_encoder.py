"""The frozen image encoder: EfficientNet-Lite0 written in kvyard, read from the released weights file (fetched
and verified like a model), equals the reference implementation exactly; a file that is not it is named."""

import pytest
import torch
from efficientnet_lite_pytorch import EfficientNet

from kvyard.errors import CheckpointError
from kvyard.loader.registry import resolve_model
from kvyard.vision.encoder import load_encoder, normalise


@pytest.fixture(scope="module")
def weights():
    return resolve_model("efficientnet-lite0")


@pytest.mark.parametrize("size", [64, 224])
def test_features_and_logits_equal_the_reference(weights, size):
    ours = load_encoder(weights)
    reference = EfficientNet.from_pretrained("efficientnet-lite0", weights_path=str(weights), image_size=size).eval()
    torch.manual_seed(size)
    pixels = normalise(torch.rand(2, 3, size, size))
    with torch.no_grad():
        assert torch.equal(ours.features(pixels), reference.extract_features(pixels))
        assert torch.equal(ours(pixels), reference(pixels))
    assert ours.features(pixels).shape == (2, 1280, -(-size // 32), -(-size // 32))
    assert not any(p.requires_grad for p in ours.parameters())  # frozen


def test_a_file_that_is_not_the_encoder_is_named(weights, tmp_path):
    garbage = tmp_path / "garbage.pth"
    garbage.write_bytes(b"not a pickle")
    with pytest.raises(CheckpointError, match="garbage.pth: not a readable EfficientNet-Lite0 weights file"):
        load_encoder(garbage)
    state = torch.load(weights, weights_only=True)
    del state["_blocks.3._depthwise_conv.weight"]
    torch.save(state, tmp_path / "missing.pth")
    with pytest.raises(CheckpointError, match="missing.pth: not EfficientNet-Lite0's weights.*_blocks.3._depthwise"):
        load_encoder(tmp_path / "missing.pth")
