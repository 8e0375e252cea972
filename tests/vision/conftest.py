"""A graft directory of the tiny model for the serving tests."""

import pytest
import torch
from safetensors.torch import save_file

from kvyard.loader.checkpoint import load_checkpoint
from kvyard.vision.config import GraftConfig
from kvyard.vision.encoder import HEAD_CHANNELS
from kvyard.vision.graft import PLACEHOLDER, GraftFormat
from kvyard.vision.projector import Projector

TOKENS = 4


@pytest.fixture(scope="session")
def graft_dir(tiny_checkpoint, tmp_path_factory):
    """A graft of the tiny model: a random projector (what it says does not matter here, only that it is used)."""
    base = tiny_checkpoint("llama")
    ckpt = load_checkpoint(base)
    hidden = ckpt.hf_config["hidden_size"]
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("graft")
    projector = Projector(HEAD_CHANNELS, hidden, TOKENS, width=64)
    save_file({k: v.contiguous() for k, v in projector.state_dict().items()}, str(out / "projector.safetensors"))
    GraftConfig(model=str(base), encoder="efficientnet-lite0", tokens=TOKENS, width=64, feature_dim=HEAD_CHANNELS,
                hidden=hidden, placeholder=PLACEHOLDER,
                placeholder_id=GraftFormat(ckpt.tokenizer, TOKENS).placeholder_id).write(out)
    return out
