"""Every fidelity figure against a direct float64 computation with HF transformers on the same weights."""

import numpy as np
import pytest
import torch

from kvyard.loader.checkpoint import load_checkpoint
from kvyard.models.decoder import DecoderModel
from kvyard.quant.fidelity import FidelityMeter, kl_per_token, sequence_logits
from kvyard.quant.plan import linear_units, quantize_stream, uniform_plan
from kvyard.quant.qtensor import QuantizedTensor
from kvyard.quant.scheme import parse_weight_scheme
from tests.conftest import hf_reference

SEQS = [[5, 17, 42, 8, 99, 3, 250, 7, 61, 12, 30], [1, 2, 3, 4, 5, 6, 7], [300, 20, 10, 77, 140, 9, 9, 9]]


def _model(path, stream=None) -> DecoderModel:
    ckpt = load_checkpoint(path)
    m = DecoderModel(ckpt.config, torch.float32, torch.device("cpu"), max_positions=64)
    m.load(stream(ckpt) if stream else ckpt.tensors(), str(path))
    return m


def test_sequence_logits_match_transformers(tiny_checkpoint):
    path = tiny_checkpoint("qwen2")
    ours = sequence_logits(_model(path), SEQS[0])
    with torch.no_grad():
        ref = hf_reference(path)(torch.tensor([SEQS[0]])).logits[0]
    assert (ours - ref).abs().max().item() < 1e-3


def test_kl_per_token_matches_definition():
    torch.manual_seed(0)
    p_logits, q_logits = torch.randn(6, 50) * 3, torch.randn(6, 50) * 3
    p = torch.softmax(p_logits.double(), -1).numpy()
    q = torch.softmax(q_logits.double(), -1).numpy()
    direct = (p * (np.log(p) - np.log(q))).sum(-1)
    ours = kl_per_token(p_logits.log_softmax(-1), q_logits).numpy()
    np.testing.assert_allclose(ours, direct, rtol=1e-4)
    assert kl_per_token(p_logits.log_softmax(-1), p_logits).abs().max() < 1e-6


@pytest.mark.parametrize("scheme", ["int8", "int4-g32"])
def test_meter_figures_match_a_direct_computation(tiny_checkpoint, scheme):
    path = tiny_checkpoint("llama")
    ckpt = load_checkpoint(path)
    plan = uniform_plan(ckpt.config, parse_weight_scheme(scheme), protect=())
    fid = FidelityMeter(_model(path), SEQS).measure(_model(path, lambda c: quantize_stream(c.tensors(), plan)))

    # Direct: HF in float64, once with the original weights and once with the dequantized ones.
    full = hf_reference(path).double()
    quant = type(full)(full.config).double().eval()
    state = {k: v.double() for k, v in full.state_dict().items()}
    for name, s in plan.items():
        state[name + ".weight"] = QuantizedTensor.quantize(state[name + ".weight"].float(), s).dequantize().double()
    quant.load_state_dict(state)
    kls, agree, nll_full, nll_quant = [], [], [], []
    with torch.no_grad():
        for ids in SEQS:
            lp = full(torch.tensor([ids])).logits[0].log_softmax(-1).numpy()
            lq = quant(torch.tensor([ids])).logits[0].log_softmax(-1).numpy()
            kls.append((np.exp(lp) * (lp - lq)).sum(-1))
            agree.append(lp.argmax(-1) == lq.argmax(-1))
            nll_full += [-lp[i, t] for i, t in enumerate(ids[1:])]
            nll_quant += [-lq[i, t] for i, t in enumerate(ids[1:])]
    kl = np.concatenate(kls)
    assert kl.mean() > 1e-6  # the quantization really changed the model
    assert fid.tokens == kl.size
    assert fid.kl_mean == pytest.approx(kl.mean(), rel=1e-3, abs=1e-6)
    assert fid.kl_p99 == pytest.approx(np.quantile(kl, 0.99), rel=1e-3, abs=1e-6)
    assert fid.kl_max == pytest.approx(kl.max(), rel=1e-3, abs=1e-6)
    assert fid.top1_agreement == pytest.approx(np.concatenate(agree).mean())
    assert fid.ppl_full == pytest.approx(np.exp(np.mean(nll_full)), rel=1e-4)
    assert fid.ppl_quant == pytest.approx(np.exp(np.mean(nll_quant)), rel=1e-4)


def test_units_cover_every_linear_weight(tiny_checkpoint):
    ckpt = load_checkpoint(tiny_checkpoint("qwen2"))
    cfg = ckpt.config
    members = [m for u in linear_units(cfg) for m in u.members]
    assert len(members) == 7 * cfg.num_layers + 1
    shapes = {n.removesuffix(".weight"): t.shape for n, t in ckpt.tensors() if n.endswith(".weight")}
    for u in linear_units(cfg):
        if u.layer is not None:
            assert u.params == sum(shapes[m].numel() for m in u.members)
