"""kvyard quantize end to end on a tiny model: plan, budget, protection, save -> load -> generate."""

import json

import pytest
import torch

from kvyard.cli.main import main
from kvyard.config import EngineConfig
from kvyard.errors import ConfigError
from kvyard.llm import LLM
from kvyard.quant.calib import valid_tool_call
from kvyard.quant.tool import QuantizeOptions, load_reference, quantize_model, saved_fidelity
from kvyard.sampling_params import SamplingParams
from tests.quant.same_kl import same_kl


def _opts(path, out, **kw) -> QuantizeOptions:
    base = dict(model=str(path), out=out, dtype="float32", progress=False, max_seq_len=64)
    return QuantizeOptions(**{**base, **kw})


def _measure_loaded(src, out) -> float:
    """Re-measure the mean KL of the saved directory from scratch, against the source checkpoint."""
    source = load_reference(QuantizeOptions(model=str(src), scheme="int8", dtype="float32", max_seq_len=64))
    return saved_fidelity(source, out).kl_mean


def test_mixed_plan_respects_budget_and_protects_head(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("llama")
    # A budget between the least and the most sensitive unit, so the search must choose.
    probe = quantize_model(_opts(src, None, scheme="int4-g32", tool_eval=False))
    kls = sorted(f.kl_mean for f in probe.sensitivity.values())
    budget = kls[len(kls) // 2] * 2
    r = quantize_model(_opts(src, tmp_path / "mixed", scheme="mixed", kl_budget=budget, mixed_weight="int4-g32"))
    assert r.fidelity.kl_mean <= budget
    assert "lm_head" not in r.plan and all(not u.name == "lm_head" for u in r.units)
    assert 0 < len(r.chosen) < len(r.units)
    assert r.searched.params >= r.naive.params
    assert r.searched.fidelity.kl_mean <= budget and r.naive.fidelity.kl_mean <= budget
    # What was measured is what was saved: a fresh load gives the same joint KL.
    assert same_kl(r.fidelity.kl_mean, _measure_loaded(src, tmp_path / "mixed"))
    cfg = json.loads((tmp_path / "mixed" / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "compressed-tensors" and "lm_head" in cfg["ignore"]
    plan = json.loads((tmp_path / "mixed" / "quant_plan.json").read_text())
    assert sum(u["quantized"] for u in plan["units"]) == len(r.chosen)
    assert set(r.tool_json) == {"full", "quant"}


@pytest.mark.parametrize("scheme", ["int8", "int4-g64-asym", "int4-g32-min"])
def test_quantize_save_load_generate(tiny_checkpoint, tmp_path, scheme):
    src = tiny_checkpoint("qwen2")
    out = tmp_path / scheme
    # Load-time quantization rounds the source weights as they are, so compare without activation scaling.
    r = quantize_model(_opts(src, out, scheme=scheme, sensitivity=False, tool_eval=False, scaling="none"))
    assert len(r.chosen) == len(r.units)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    loaded = LLM(config=EngineConfig(model=str(out), dtype="float32"))
    on_load = LLM(config=EngineConfig(model=str(src), dtype="float32", quantization=scheme))
    prompts = ["hello world", "def add(a, b):"]
    a = [o.outputs[0].token_ids for o in loaded.generate(prompts, params)]
    b = [o.outputs[0].token_ids for o in on_load.generate(prompts, params)]
    assert a == b and all(len(t) == 16 for t in a)
    layer = loaded.engine.runner.model.layers[0]
    assert not isinstance(layer.qkv, torch.Tensor) and isinstance(loaded.engine.runner.model.lm_head, torch.Tensor)
    if scheme.startswith("int4"):  # held as int4 (under a byte a weight with its scales), whichever kernel takes it
        gate_up = layer.gate_up
        assert gate_up.nbytes < gate_up.out_features * gate_up.in_features


def test_unprotected_head_is_quantized(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("llama", tie_word_embeddings=True)
    r = quantize_model(_opts(src, tmp_path / "q", scheme="int8", protect=(), sensitivity=False, tool_eval=False))
    assert "lm_head" in r.plan
    llm = LLM(config=EngineConfig(model=str(tmp_path / "q"), dtype="float32"))
    model = llm.engine.runner.model
    assert not isinstance(model.lm_head, torch.Tensor) and isinstance(model.embed, torch.Tensor)
    assert len(llm.generate(["hello"], SamplingParams(max_tokens=4, ignore_eos=True))[0].outputs[0].token_ids) == 4


def test_head_scheme_quantizes_the_head_in_its_own_format(tiny_checkpoint, tmp_path):
    """--head-scheme int8 beside int4 layers (as llama.cpp keeps the output tensor at more bits): the plan, the
    saved config and the loaded model hold the head in int8 and the layers in int4, and the KL is what a fresh
    load measures."""
    src, out = tiny_checkpoint("llama", tie_word_embeddings=True), tmp_path / "h"
    r = quantize_model(_opts(src, out, scheme="int4-g32", head_scheme="int8", sensitivity=False, tool_eval=False))
    assert r.plan["lm_head"].name == "int8" and r.plan["model.layers.0.mlp.down_proj"].name == "int4-g32"
    assert "lm_head" in r.chosen and r.request.head is not None and r.request.head.name == "int8"
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qcfg["format"] == "mixed-precision" and "lm_head" not in qcfg["ignore"]
    heads = [g for g in qcfg["config_groups"].values() if "lm_head" in g["targets"]]
    assert heads[0]["weights"]["num_bits"] == 8 and heads[0]["targets"] == ["lm_head"]
    assert json.loads((out / "quant_plan.json").read_text())["head_format"] == "int8"
    assert same_kl(r.fidelity.kl_mean, _measure_loaded(src, out))
    model = LLM(config=EngineConfig(model=str(out), dtype="float32")).engine.runner.model
    assert model.lm_head.bits == 8 and model.layers[0].down.bits == 4
    # without it the head stays protected (dense)
    plain = quantize_model(_opts(src, None, scheme="int4-g32", sensitivity=False, tool_eval=False))
    assert "lm_head" not in plain.plan and plain.request.head is None


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(scheme="mixed"), "needs --kl-budget"),
        (dict(scheme="mixed", kl_budget=-1.0), "positive"),
        (dict(scheme="int5"), "unknown quantization scheme"),
        (dict(scheme="int4-g100"), "group size"),
        (dict(scheme="int8", outlier_columns=0.7), "share of each layer"),
        (dict(scheme="int8", outlier_columns=-0.1), "share of each layer"),
        (dict(scheme="int8", outlier_columns=0.05, rounding="gptq"), "round to nearest"),
        (dict(scheme="int4-g128", head_scheme="int6"), "unknown quantization scheme"),
    ],
)
def test_bad_scheme_or_budget_is_a_clear_error(tiny_checkpoint, tmp_path, kw, match):
    with pytest.raises(ConfigError, match=match):
        quantize_model(_opts(tiny_checkpoint("llama"), tmp_path / "x", **kw))


def test_cli_writes_reports(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "cli"
    rc = main(["quantize", "--model", str(tiny_checkpoint("llama")), "--scheme", "int4-g32", "--out", str(out),
               "--dtype", "float32", "--max-seq-len", "64"])
    assert rc == 0
    for name in ("quant_report.md", "quant_report.json", "sensitivity.png", "model.safetensors", "config.json"):
        assert (out / name).is_file()
    report = json.loads((out / "quant_report.json").read_text())
    assert report["fidelity"]["kl_mean"] > 0 and 0 <= report["fidelity"]["top1_agreement"] <= 1
    assert "KL(p_full" in capsys.readouterr().out
    assert main(["quantize", "--model", str(tiny_checkpoint("llama")), "--scheme", "mixed", "--out", str(out)]) == 2


def test_valid_tool_call_parsing():
    assert valid_tool_call('sure: {"name": "f", "arguments": {"x": 1}} done')
    assert not valid_tool_call('{"name": "f", "arguments": {"x": 1}')
    assert not valid_tool_call('{"arguments": {}}')


def test_gptq_rounding_saves_and_reloads(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("llama")
    out = tmp_path / "gptq"
    r = quantize_model(_opts(src, out, scheme="int4-g32", rounding="gptq", sensitivity=False, tool_eval=False))
    assert r.rounding == "gptq" and json.loads((out / "quant_plan.json").read_text())["rounding"] == "gptq"
    # The checkpoint format is round to nearest's: a fresh load measures the same KL.
    assert same_kl(r.fidelity.kl_mean, _measure_loaded(src, out))


def test_unknown_rounding_or_scaling_is_a_config_error(tiny_checkpoint):
    with pytest.raises(ConfigError, match="rounding"):
        quantize_model(_opts(tiny_checkpoint("llama"), None, scheme="int8", rounding="awq"))
    with pytest.raises(ConfigError, match="scaling"):
        quantize_model(_opts(tiny_checkpoint("llama"), None, scheme="int8", scaling="smooth"))


def test_outlier_columns_save_reload_and_serve(tiny_checkpoint, tmp_path):
    """--outlier-columns: each unit keeps its most active input columns exactly; the saved directory measures
    as the in-memory model did, and loads and generates."""
    src, out = tiny_checkpoint("qwen2"), tmp_path / "o"
    r = quantize_model(_opts(src, out, scheme="int4-g32", sensitivity=False, tool_eval=False, scaling="none",
                             outlier_columns=0.05))
    assert r.outlier_columns == 0.05 and json.loads((out / "quant_plan.json").read_text())["outlier_columns"] == 0.05
    assert json.loads((out / "config.json").read_text())["quantization_config"]["kvyard_outlier_columns"] == 0.05
    source = load_reference(QuantizeOptions(model=str(src), scheme="int8", dtype="float32", max_seq_len=64))
    assert same_kl(r.fidelity.kl_mean, saved_fidelity(source, out).kl_mean)
    from safetensors.torch import load_file
    saved = load_file(str(out / "model.safetensors"))
    cols = saved["model.layers.0.mlp.down_proj.weight_outlier_columns"]
    assert cols.numel() == round(0.05 * 128)  # intermediate_size 128
    assert torch.equal(saved["model.layers.0.mlp.down_proj.weight_outliers"],
                       source.tensors["model.layers.0.mlp.down_proj.weight"][:, cols].float())
    llm = LLM(config=EngineConfig(model=str(out), kv_cache_memory="16MiB"))
    assert len(llm.generate(["hello"], SamplingParams(max_tokens=4, ignore_eos=True))[0].outputs[0].token_ids) == 4
