"""`kvyard graft vision` end to end on a tiny language model: the projector's least-squares start, its training
(the loss goes down), the held-out evaluation with, without and blind to the image, and the files written."""

import json

import torch
from safetensors.torch import load_file

from kvyard.cli.main import main
from kvyard.loader.checkpoint import load_checkpoint
from kvyard.vision.graft import PLACEHOLDER, GraftFormat
from kvyard.vision.projector import Projector


def test_a_graft_trains_and_is_written(tiny_checkpoint, tmp_path):
    base = tiny_checkpoint("llama")
    out = tmp_path / "graft"
    assert main(["graft", "vision", "--model", str(base), "--out", str(out), "--train-questions", "96",
                 "--eval-questions", "6", "--epochs", "3", "--batch", "16", "--lr", "3e-3", "--no-progress"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["steps"] == 18 and report["last_loss"] < report["first_loss"]
    assert 0 <= report["least_squares_relative_error"] < 1
    assert set(report["accuracy"]) == {"graft_least_squares_only", "graft", "blind", "text_only"}
    assert all(set(a) >= {"all"} for a in report["accuracy"].values())
    config = json.loads((out / "graft.json").read_text())
    assert config["tokens"] == 4 and config["placeholder"] == PLACEHOLDER and config["feature_dim"] == 1280
    projector = Projector(config["feature_dim"], config["hidden"], config["tokens"], config["width"])
    projector.load_state_dict(load_file(out / "projector.safetensors"))
    assert projector(torch.zeros(1, 1280, 2, 2)).shape == (1, 4, config["hidden"])


def test_the_image_takes_the_placeholders_positions(tiny_checkpoint):
    tokenizer = load_checkpoint(tiny_checkpoint("llama")).tokenizer
    fmt = GraftFormat(tokenizer, tokens=3)
    with_image, without = fmt.prompt("what colour?", True), fmt.prompt("what colour?", False)
    at = with_image.image_at
    assert with_image.ids[at : at + 3] == [fmt.placeholder_id] * 3 and without.image_at is None
    assert fmt.placeholder_id not in with_image.ids[:at] + with_image.ids[at + 3 :]


def test_least_squares_recovers_a_linear_target():
    torch.manual_seed(0)
    projector = Projector(8, 4, tokens=2, width=64)
    features = torch.randn(256, 8, 1, 1)
    targets = torch.randn(256, 2, 4) * 0.01 + projector.activations(features)[:, :8].reshape(256, 2, 4)
    assert projector.fit_least_squares(features, targets, ridge=1e-6) < 0.05
    assert torch.allclose(projector(features), targets, atol=0.05)
