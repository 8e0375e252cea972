"""Activation-aware scaling: the folds leave the model's function unchanged, and the search never loses."""

import json

import pytest
import torch

from kvyard.loader.checkpoint import load_checkpoint
from kvyard.models.decoder import DecoderModel
from kvyard.quant.awq import fold, output_error, scale_units, search_scale
from kvyard.quant.calib import DEFAULT_TEXT, build_calibration
from kvyard.quant.fidelity import sequence_logits
from kvyard.quant.hessian import collect_hessians
from kvyard.quant.plan import linear_units
from kvyard.quant.qtensor import QuantizedTensor
from kvyard.quant.scheme import WeightScheme
from kvyard.quant.tool import QuantizeOptions, quantize_model
from tests.quant.same_kl import same_kl
from tests.quant.test_tool import _measure_loaded


def _logits(ckpt, tensors: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    model = DecoderModel(ckpt.config, torch.float32, torch.device("cpu"), max_positions=64)
    model.load(tensors.items(), "test")
    with torch.inference_mode():
        return sequence_logits(model, ids)


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])  # qwen2: q|k|v biases, so v's bias is folded too
def test_folding_any_scale_keeps_the_model_the_same(tiny_checkpoint, model_type):
    ckpt = load_checkpoint(tiny_checkpoint(model_type))
    tensors = dict(ckpt.tensors())
    cfg = ckpt.config
    folded = dict(tensors)
    gen = torch.Generator().manual_seed(0)
    group = cfg.num_heads // cfg.num_kv_heads
    for u in linear_units(cfg):
        if u.layer is None:
            continue
        k = folded[u.members[0] + ".weight"].shape[1]
        s = torch.rand(k, generator=gen) * 3 + 0.2
        if u.attr == "o":  # o_proj's scale must be one per KV channel
            s = s.view(cfg.num_kv_heads, group, cfg.head_dim)[:, :1].expand(-1, group, -1).reshape(-1)
        fold(folded, cfg, u, s)
    assert not torch.equal(folded["model.layers.0.mlp.up_proj.weight"], tensors["model.layers.0.mlp.up_proj.weight"])
    ids = ckpt.tokenizer("def add(a, b): return a + b", add_special_tokens=True).input_ids
    torch.testing.assert_close(_logits(ckpt, folded, ids), _logits(ckpt, tensors, ids), rtol=1e-4, atol=1e-4)


def test_search_prefers_scaling_when_one_channel_dominates():
    torch.manual_seed(0)
    x = torch.randn(512, 64)
    x[:, 3] *= 30.0  # a channel with large activations, as LLM layers have
    h = 2 * x.t() @ x / x.shape[0]
    w = torch.randn(32, 64)
    scheme = WeightScheme(bits=4, group_size=32)
    alpha, s, ratio = search_scale(w, h, scheme)
    assert alpha > 0 and ratio < 0.9 and s[3] == s.max()
    rtn = output_error(w, QuantizedTensor.quantize(w, scheme).dequantize(), h)
    scaled = output_error(w, QuantizedTensor.quantize(w * s, scheme).dequantize() / s, h)
    assert scaled == pytest.approx(ratio * rtn, rel=1e-5)


def test_scale_units_never_raises_a_units_output_error(tiny_checkpoint):
    ckpt = load_checkpoint(tiny_checkpoint("llama"))
    tensors = dict(ckpt.tensors())
    model = DecoderModel(ckpt.config, torch.float32, torch.device("cpu"), max_positions=64)
    model.load(tensors.items(), "test")
    units = [u for u in linear_units(ckpt.config) if u.layer is not None]
    seqs = build_calibration(ckpt.tokenizer, DEFAULT_TEXT, 48).sequences
    with torch.inference_mode():
        hessians = collect_hessians(model, units, seqs)
    _, chosen = scale_units(tensors, ckpt.config, units, hessians, WeightScheme(bits=4, group_size=32))
    assert set(chosen) == {u.name for u in units}
    assert all(c.error_ratio <= 1.0 for c in chosen.values())
    assert any(c.alpha > 0 for c in chosen.values())


def test_awq_checkpoint_measures_the_same_after_reload(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("qwen2")
    out = tmp_path / "awq"
    r = quantize_model(QuantizeOptions(model=str(src), scheme="int4-g32", out=out, dtype="float32", progress=False,
                                       max_seq_len=64, sensitivity=False, tool_eval=False, scaling="awq"))
    # What was measured is what was saved: folded norms and rows included.
    assert same_kl(r.fidelity.kl_mean, _measure_loaded(src, out))
    plan = json.loads((out / "quant_plan.json").read_text())
    assert plan["scaling"] == "awq" and all(u["awq_alpha"] is not None for u in plan["units"])


def test_auto_scaling_keeps_the_choice_that_measures_lower(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("llama")
    r = quantize_model(QuantizeOptions(model=str(src), scheme="int4-g32", out=tmp_path / "auto", dtype="float32",
                                       progress=False, max_seq_len=64, sensitivity=False, tool_eval=False))
    # Judged on the calibration sequences the trial scales were not fitted on.
    assert set(r.scaling_trial) == {"none", "awq"}
    kept = "awq" if r.scaling else "none"
    assert r.scaling_trial[kept] == min(r.scaling_trial.values())
    if kept == "none":  # then nothing was scaled: the result is plain rounding, measured on every sequence
        plain = quantize_model(QuantizeOptions(model=str(src), scheme="int4-g32", dtype="float32", progress=False,
                                               max_seq_len=64, sensitivity=False, tool_eval=False, scaling="none"))
        assert same_kl(plain.fidelity.kl_mean, r.fidelity.kl_mean)
    assert same_kl(r.fidelity.kl_mean, _measure_loaded(src, tmp_path / "auto"))
