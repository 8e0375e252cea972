"""GPTQ rounding: value range, lower output error than round to nearest, and the saved format."""

import pytest
import torch

from kvyard.quant.gptq import gptq_quantize, inverse_hessian_factor
from kvyard.quant.hessian import collect_hessians
from kvyard.quant.plan import linear_units
from kvyard.quant.qtensor import QuantizedTensor
from kvyard.quant.scheme import parse_weight_scheme

SCHEMES = ["int8", "int4-g32", "int4-g64-asym", "int4-g128", "int4-g32-min"]


def _correlated_inputs(rows: int, k: int, seed: int = 0) -> torch.Tensor:
    """Inputs with a few strong shared directions, as a transformer's hidden states have; `seed` draws
    other samples of the same distribution."""
    basis = torch.randn(8, k, generator=torch.Generator().manual_seed(1234)) * 4
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 8, generator=g) @ basis + 0.3 * torch.randn(rows, k, generator=g)


@pytest.mark.parametrize("name", SCHEMES)
@pytest.mark.parametrize("shape", [(48, 256), (7, 200)])
def test_range_and_shapes(name, shape):
    scheme = parse_weight_scheme(name)
    n, k = shape
    x = _correlated_inputs(512, k)
    qt = gptq_quantize(torch.randn(shape), 2 * x.t() @ x / len(x), scheme)
    rtn = QuantizedTensor.quantize(torch.randn(shape), scheme)
    assert qt.q.dtype == torch.int8 and qt.shape == shape
    assert int(qt.q.min()) >= scheme.qmin and int(qt.q.max()) <= scheme.qmax
    assert qt.scale.shape == rtn.scale.shape and qt.scale.dtype == torch.float32 and (qt.scale > 0).all()
    assert (qt.zero_point is None) == (rtn.zero_point is None)
    if qt.zero_point is not None:
        assert qt.zero_point.shape == rtn.zero_point.shape and qt.zero_point.dtype == rtn.zero_point.dtype


@pytest.mark.parametrize("name", SCHEMES)
def test_lower_output_error_than_rtn(name):
    scheme = parse_weight_scheme(name)
    torch.manual_seed(1)
    w = torch.randn(64, 256)
    x = _correlated_inputs(1024, 256)
    held_out = _correlated_inputs(1024, 256, seed=1)  # same distribution, other samples
    gptq = gptq_quantize(w, 2 * x.t() @ x / len(x), scheme)
    rtn = QuantizedTensor.quantize(w, scheme)
    for inputs in (x, held_out):
        err_gptq = (inputs @ (w - gptq.dequantize()).t()).norm()
        err_rtn = (inputs @ (w - rtn.dequantize()).t()).norm()
        assert err_gptq < 0.5 * err_rtn, (name, float(err_gptq), float(err_rtn))


def test_identity_hessian_is_round_to_nearest():
    """With uncorrelated inputs there is no other column to move the error to: GPTQ is plain rounding."""
    w = torch.randn(16, 128)
    for name in ("int8", "int4-g32-asym"):
        scheme = parse_weight_scheme(name)
        got, want = gptq_quantize(w, torch.eye(128), scheme, damp=0.0), QuantizedTensor.quantize(w, scheme)
        assert torch.equal(got.q, want.q) and torch.allclose(got.scale, want.scale)


def test_rank_deficient_hessian_still_factors():
    x = torch.randn(10, 64)  # fewer samples than inputs, and one input never active
    x[:, 5] = 0
    u = inverse_hessian_factor(2 * x.t() @ x)
    assert torch.isfinite(u).all() and (u.diagonal() > 0).all()


def test_state_dict_roundtrip():
    scheme = parse_weight_scheme("int4-g64-asym")
    x = _correlated_inputs(256, 96)
    qt = gptq_quantize(torch.randn(40, 96), x.t() @ x, scheme)
    back = QuantizedTensor.from_state_dict(qt.to_state_dict("l."), "l.", scheme, "test")
    assert torch.equal(back.q, qt.q) and torch.equal(back.dequantize(), qt.dequantize())


def test_collect_hessians_restores_the_model(tiny_checkpoint):
    from kvyard.loader.checkpoint import load_checkpoint
    from kvyard.models.decoder import DecoderModel
    from kvyard.quant.fidelity import batch_logits

    ckpt = load_checkpoint(tiny_checkpoint("llama"))
    model = DecoderModel(ckpt.config, torch.float32, torch.device("cpu"), max_positions=64)
    model.load(ckpt.tensors(), "tiny")
    seqs = [[1, 5, 9, 3, 7], [2, 4, 6]]
    before = batch_logits(model, seqs)
    units = linear_units(ckpt.config)
    hessians = collect_hessians(model, units, seqs)
    after = batch_logits(model, seqs)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    for u in units:
        h = hessians[u.name]
        k = ckpt.config.intermediate_size if u.attr == "down" else h.shape[0]
        assert h.shape == (k, k) and torch.allclose(h, h.t()) and not h.is_inference()


def test_sequential_gptq_quantizes_every_member_and_restores_the_model(tiny_checkpoint):
    from kvyard.loader.checkpoint import load_checkpoint
    from kvyard.models.decoder import DecoderModel
    from kvyard.quant.fidelity import batch_logits
    from kvyard.quant.sequential import sequential_gptq

    ckpt = load_checkpoint(tiny_checkpoint("llama"))
    tensors = dict(ckpt.tensors())
    model = DecoderModel(ckpt.config, torch.float32, torch.device("cpu"), max_positions=64)
    model.load(tensors.items(), "tiny")
    seqs = [[1, 5, 9, 3, 7, 2, 8], [2, 4, 6, 1]]
    before = batch_logits(model, seqs)
    units = linear_units(ckpt.config)  # lm_head included
    scheme = parse_weight_scheme("int4-g32")
    seen = {}

    def quantize_unit(u, h):
        seen[u.name] = h
        return {m: gptq_quantize(tensors.get(m + ".weight", tensors["model.embed_tokens.weight"]), h, scheme)
                for m in u.members}

    out = sequential_gptq(model, units, seqs, quantize_unit)
    assert set(out) == {m for u in units for m in u.members}
    assert set(seen) == {u.name for u in units} and not any(h.is_inference() for h in seen.values())
    # Layer 0 sees the same inputs as the dense model: its Hessian matches the one-shot collection.
    one_shot = collect_hessians(model, units, seqs)
    first = units[0].name
    assert torch.allclose(seen[first], one_shot[first], rtol=1e-4, atol=1e-5)
    assert not torch.allclose(seen[units[-2].name], one_shot[units[-2].name])  # later layers: quantized inputs
    after = batch_logits(model, seqs)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
