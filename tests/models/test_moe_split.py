"""`kvyard moe split` on a tiny llama: with every expert active the Mixtral it writes is the dense model; with
fewer, a fitted router and a measured divergence."""

import json

import torch

from kvyard import LLM, SamplingParams
from kvyard.cli.main import main
from tests.conftest import hf_reference

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPTS = ["The quick brown fox", "def add(a, b):\n    return a + b\n", "Paged attention keeps the KV cache"]


def test_all_experts_active_equal_the_dense_model(tiny_checkpoint, tmp_path):
    dense_path, out = tiny_checkpoint("llama"), tmp_path / "moe"
    assert main(["moe", "split", "--model", str(dense_path), "--experts", "4", "--out", str(out),
                 "--calibration-prompts", "2", "--eval-prompts", "2"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["top_k"] == 4 and report["kl_mean"] < 1e-6 and report["top1_agreement"] == 1.0
    dense, moe = LLM(str(dense_path), dtype="float32"), LLM(str(out), dtype="float32")
    assert moe.engine.model_config.model_type == "mixtral" and moe.engine.model_config.num_experts == 4
    prompts = [dense.tokenizer(p).input_ids for p in PROMPTS]
    want = [o.outputs[0].token_ids for o in dense.generate(prompts, GREEDY)]
    assert [o.outputs[0].token_ids for o in moe.generate(prompts, GREEDY)] == want
    for p in prompts:
        assert (moe.engine.compute_logits(p) - dense.engine.compute_logits(p)).abs().max().item() <= 1e-3
    # transformers reads the split checkpoint as a Mixtral and agrees
    with torch.no_grad():
        theirs = hf_reference(out)(torch.tensor([prompts[0]])).logits[0, -1]
    assert (moe.engine.compute_logits(prompts[0]) - theirs).abs().max().item() <= 1e-4


def test_top_k_fits_a_router_and_reports_the_divergence(tiny_checkpoint, tmp_path):
    out = tmp_path / "moe2"
    assert main(["moe", "split", "--model", str(tiny_checkpoint("llama")), "--experts", "4", "--top-k", "2",
                 "--out", str(out), "--calibration-prompts", "4", "--eval-prompts", "2"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["top_k"] == 2 and report["calibration_tokens"] > 0 and 0 < report["kl_mean"] < 50
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_experts_per_tok"] == 2 and cfg["intermediate_size"] == 128 // 4
    assert LLM(str(out), dtype="float32").generate(["The quick"], GREEDY)[0].outputs[0].token_ids


def test_a_split_that_cannot_divide_says_why(tiny_checkpoint, tmp_path, capsys):
    assert main(["moe", "split", "--model", str(tiny_checkpoint("llama")), "--experts", "5", "--out",
                 str(tmp_path / "x")]) == 2
    assert "5 experts must divide the MLP's 128 neurons" in capsys.readouterr().err
