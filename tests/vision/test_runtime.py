"""A graft directory that cannot be served is named with the reason: its config, its projector, a model of
another width."""

import json
import shutil

import pytest

from kvyard.errors import CheckpointError
from kvyard.vision.config import GraftConfig, is_graft
from kvyard.vision.runtime import VisionGraft


def test_a_good_graft_loads(graft_dir):
    config = GraftConfig.read(graft_dir)
    assert is_graft(graft_dir) and not is_graft(graft_dir / "projector.safetensors")
    assert VisionGraft(graft_dir, config.hidden).projector.tokens == config.tokens


def test_a_broken_graft_is_named_with_the_reason(graft_dir, tmp_path):
    hidden = GraftConfig.read(graft_dir).hidden
    with pytest.raises(CheckpointError, match=r"graft.json: .* embeddings are 7 wide"):
        VisionGraft(graft_dir, 7)
    broken = tmp_path / "broken"
    shutil.copytree(graft_dir, broken)
    (broken / "projector.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(CheckpointError, match=r"projector.safetensors: not this graft's projector"):
        VisionGraft(broken, hidden)
    config = json.loads((broken / "graft.json").read_text())
    del config["tokens"]
    (broken / "graft.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"graft.json: a graft config needs tokens"):
        VisionGraft(broken, hidden)
    (broken / "graft.json").write_text("{")
    with pytest.raises(CheckpointError, match=r"graft.json: not a readable graft config"):
        VisionGraft(broken, hidden)
