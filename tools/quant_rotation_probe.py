"""Does rotating the residual stream (QuaRot / SpinQuant's R1, folded into the weights) help weight-only
quantization? The RMSNorm gains are folded into the matmuls after them, a random orthogonal Q rotates every
matmul's input (q|k|v, gate|up, LM head) and output (o, down) and the embedding, so the model computes the
same function; then every decoder-layer weight is rounded (and put back dense) with and without Q, float32
on both sides, KL against the source on the calibration set and on held-out text.

usage: python tools/quant_rotation_probe.py MODEL SCHEMES      e.g. smollm2-135m int8,int4-g128
"""
import dataclasses
import sys

import torch
from quant_rounding_kl import HELD_OUT  # the same held-out passages (this script's folder is on sys.path)

from kvyard.models.decoder import DecoderModel
from kvyard.quant.calib import build_calibration
from kvyard.quant.fidelity import FidelityMeter
from kvyard.quant.plan import DEFAULT_PROTECT, is_protected, linear_units
from kvyard.quant.qtensor import QuantizedTensor
from kvyard.quant.scheme import parse_weight_scheme
from kvyard.quant.tool import QuantizeOptions, load_reference


def rotated(tensors: dict[str, torch.Tensor], cfg, seed: int = 0) -> dict[str, torch.Tensor]:
    """The same model with its residual stream rotated by a random orthogonal matrix; norms become ones."""
    t = {k: v.double() for k, v in tensors.items()}
    d = cfg.hidden_size
    g = torch.Generator().manual_seed(seed)
    Q, R = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    Q = Q * torch.sign(torch.diagonal(R))
    head = t.get("lm_head.weight", t["model.embed_tokens.weight"])
    t["lm_head.weight"] = (head * t["model.norm.weight"]) @ Q
    t["model.norm.weight"] = torch.ones(d, dtype=torch.float64)
    t["model.embed_tokens.weight"] = t["model.embed_tokens.weight"] @ Q
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        for norm, ins, outs in (
            ("input_layernorm", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["self_attn.o_proj"]),
            ("post_attention_layernorm", ["mlp.gate_proj", "mlp.up_proj"], ["mlp.down_proj"]),
        ):
            gn = t[p + norm + ".weight"]
            for n in ins:
                t[p + n + ".weight"] = (t[p + n + ".weight"] * gn) @ Q
            t[p + norm + ".weight"] = torch.ones(d, dtype=torch.float64)
            for n in outs:
                t[p + n + ".weight"] = Q.T @ t[p + n + ".weight"]
    return {k: v.float() for k, v in t.items()}


def main() -> None:
    torch.set_num_threads(2)
    ref = load_reference(QuantizeOptions(model=sys.argv[1], scheme="int8", dtype="float32", progress=False))
    cfg = ref.ckpt.config
    held = FidelityMeter(ref.model, build_calibration(ref.ckpt.tokenizer, HELD_OUT, 256).sequences[: len(HELD_OUT)])
    members = [m for u in linear_units(cfg) if not is_protected(u, DEFAULT_PROTECT) for m in u.members]
    untied = dataclasses.replace(cfg, tie_word_embeddings=False)  # the rotated head folds in the final norm

    def build(tensors: dict[str, torch.Tensor], c) -> DecoderModel:
        m = DecoderModel(c, torch.float32, torch.device("cpu"), max_positions=257)
        m.load(tensors.items(), "probe")
        return m

    def report(label: str, m: DecoderModel) -> None:
        with torch.inference_mode():
            a, b = ref.meter.measure(m), held.measure(m)
        print(f"{label:28s} calibration KL {a.kl_mean:.2e} (top-1 {a.top1_agreement:.3f}) | "
              f"held-out KL {b.kl_mean:.2e} (top-1 {b.top1_agreement:.3f})", flush=True)

    def row_peak(ts: dict[str, torch.Tensor]) -> float:
        """Mean over rows of max |w| / rms(w): what per-channel rounding error scales with."""
        ws = [ts[m + ".weight"] for m in members]
        return sum((w.abs().amax(1) / w.pow(2).mean(1).sqrt()).mean().item() for w in ws) / len(ws)

    base = dict(ref.tensors)
    rot = rotated(base, cfg)
    report("rotated, unquantized", build(rot, untied))
    print(f"row max/rms, mean: source {row_peak(base):.2f}, rotated {row_peak(rot):.2f}")
    for scheme in sys.argv[2].split(","):
        for label, ts, c in (("source", base, cfg), ("rotated", rot, untied)):
            q = dict(ts)
            for m in members:
                q[m + ".weight"] = QuantizedTensor.quantize(ts[m + ".weight"], parse_weight_scheme(scheme)).dequantize()
            report(f"{scheme} {label}", build(q, c))


if __name__ == "__main__":
    main()
