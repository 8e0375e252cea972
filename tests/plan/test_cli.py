"""`kvyard plan` on the seeds' example (2.8T parameters in NVFP4 on GB300s) and on a model on disk."""

import json
import os

import pytest

from kvyard.cli.main import build_parser, main
from kvyard.errors import ConfigError

SEEDS = "params=2.8e12,layers=61,hidden=7168,heads=128,kv_lora_rank=512,rope_dim=64,vocab=129280"


def test_the_seeds_example(capsys):
    """2.8T NVFP4 parameters: 1.4 TB of values plus 175 GB of FP8 block scales; a latent cache of DeepSeek-V3's
    shape (61 layers x (512 + 64) bf16 values) is 70,272 B a token; eight GB300s hold it."""
    argv = ["plan", "--describe", SEEDS, "--weights", "nvfp4", "--hardware", "gb300", "--context", "131072",
            "--concurrency", "8"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "1575.00 GB (of which scales 175.00 GB)" in text and "70,272 B" in text
    assert main([*argv, "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["memory"]["weights"] == 2.8e12 * 0.5 + 2.8e12 / 16 and r["memory"]["kv_per_token"] == 61 * 576 * 2
    eight = {(lo["tp"], lo["pp"]): lo for lo in r["layouts"] if lo["devices"] == 8}
    norms = r["memory"]["norms"]  # every tensor rank holds them whole
    assert (8, 1) in eight and eight[(8, 1)]["weights_per_device"] == pytest.approx(
        (r["memory"]["weights"] - norms) / 8 + norms, rel=1e-12)
    # pp 8: the end stages hold the embedding and the head beside their layers, and a device needs room for the
    # largest stage; the stages hold every weight once (the head is not tied)
    pp8 = eight[(1, 8)]
    middle = r["memory"]["weights"] - r["memory"]["embedding"] - r["memory"]["head"] - r["memory"]["final_norm"]
    assert pp8["stage_weights"][1] == pytest.approx(middle / 8, rel=1e-12)
    assert pp8["weights_per_device"] == max(pp8["stage_weights"]) > r["memory"]["weights"] / 8
    assert sum(pp8["stage_weights"]) == pytest.approx(r["memory"]["weights"], rel=1e-9)
    # tp 8 replicates the latent cache on every rank; pp 8 splits it by layer: about 8 times the tokens
    assert 7 * eight[(8, 1)]["kv_tokens"] < pp8["kv_tokens"] < 8 * eight[(8, 1)]["kv_tokens"]
    assert r["devices_by_memory"] == 7 and r["best"]["flags"].startswith("kvyard serve --model MODEL")


def test_a_model_on_disk(tiny_checkpoint, capsys):
    path = tiny_checkpoint("llama")
    assert main(["plan", "--model", str(path / "config.json"), "--dtype", "float32", "--json", "--max-devices",
                 "4"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["params"] > 0 and r["layouts"][0]["devices"] == 1 and f"--model {path}" in r["best"]["flags"]
    assert {lo["tp"] for lo in r["layouts"]} <= {1, 2, 4}  # the tensor sizes the tiny model's heads allow


def test_this_machine_measured_predicts_rates(tiny_checkpoint, capsys):
    """--measure: this machine's rates and the model's matmuls timed, so every layout gets predicted rates."""
    path = tiny_checkpoint("llama")
    assert main(["plan", "--model", str(path), "--hardware", "this", "--measure", "--json", "--max-devices", "1",
                 "--concurrency", "4", "--max-num-batched-tokens", "64"]) == 0
    r = json.loads(capsys.readouterr().out)
    one, four = r["layouts"][0]["predicted"]["batch_1"], r["layouts"][0]["predicted"]["batch_4"]
    assert 0 < one["decode_tok_s"] < four["decode_tok_s"] and one["prefill_tok_s"] > 0


@pytest.mark.parametrize("argv, message", [
    (["--describe", "params=1e9,layers=2"], "needs hidden="),
    (["--describe", "params=1e9,layers=2,hidden=64,heads=4,colour=3"], "key=value pairs"),
    (["--describe", "params=1e9,layers=2,hidden=64,heads=4", "--model", "x"], "not both"),
    (["--model", "smollm2-135m", "--weights", "int3"], "unknown weight format"),
    (["--model", "smollm2-135m", "--hardware", "tpu9"], "unknown device"),
    (["--model", "smollm2-135m", "--hardware", "h100", "--measure"], "with --hardware this"),
])
def test_bad_plans_are_named(argv, message):
    args = build_parser().parse_args(["plan", *argv])
    with pytest.raises(ConfigError, match=message):
        args.func(args)


def test_bench_plan_layouts_name_a_model_and_its_ranks():
    from kvyard.bench.plan_layouts import LayoutSpec, parse_layout, sync_kind

    assert parse_layout("qwen2.5-coder-0.5b:tp2") == LayoutSpec("qwen2.5-coder-0.5b", 2, 1)
    assert parse_layout("/models/x:y:tp2pp2").ranks == 4 and parse_layout("m:pp2").label == "m tp1 pp2"
    with pytest.raises(ConfigError, match="MODEL:tpN"):
        parse_layout("smollm2-135m")
    assert sync_kind(parse_layout("m:tp2")) == "tensor_sync_s" and sync_kind(parse_layout("m:pp2")) == "stage_sync_s"
    with pytest.raises(ConfigError, match="tensor-parallel or a pipeline"):
        sync_kind(parse_layout("m:tp2pp2"))


# 30-130 s on a 2-core AVX2 EPYC (make test took 55 min there, 2026-12-07): run with -m slow
@pytest.mark.slow
def test_layouts_on_this_machine_share_its_cores(tiny_checkpoint, capsys):
    """--measure with layouts of two ranks on this machine: each is timed as its ranks would run here, sharing
    the cores, so a split divides no prefill time (a pipeline's two micro-batches take three half-steps)."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("two ranks need two cores to bind to")
    path = tiny_checkpoint("llama")
    assert main(["plan", "--model", str(path), "--hardware", "this", "--measure", "--json", "--max-devices", "2",
                 "--concurrency", "4", "--max-num-batched-tokens", "64"]) == 0
    listed = {(lo["tp"], lo["pp"]): lo for lo in json.loads(capsys.readouterr().out)["layouts"]}
    layouts = {key: lo["predicted"] for key, lo in listed.items()}
    # the ranks share this machine's memory too: a split adds no room (each rank pays its own activations)
    assert 0.99 * listed[(1, 1)]["kv_tokens"] < listed[(2, 1)]["kv_tokens"] <= listed[(1, 1)]["kv_tokens"]
    one = layouts[(1, 1)]["batch_1"]["prefill_tok_s"]
    assert 0 < layouts[(2, 1)]["batch_1"]["prefill_tok_s"] < one
    assert 0 < layouts[(1, 2)]["batch_1"]["prefill_tok_s"] < one * 2 / 3
    assert all(p["batch_4"]["decode_tok_s"] > 0 for p in layouts.values())
