"""How fast SmolLM2's decode matmuls stream their weights, each weight form alternating round by round
over the same matrices and inputs (distinct weights per layer, so nothing stays in cache between layers).

usage: python tools/gemm_stream.py            bf16: oneDNN's packed GEMM against kvyard's VNNI blocks (AMX or
                                              AVX512-BF16 kernel), the 121 matmuls of a step (30 layers
                                              and the LM head)
       python tools/gemm_stream.py --lowbit   the 120 layer matmuls: bf16 as the model holds it, int8 and
                                              int4-g128 on PyTorch's kernels, kvyard's portable kernel and
                                              (with AMX or AVX-512 VNNI) kvyard's VNNI-block kernel
       python tools/gemm_stream.py --hot      bf16, one layer of each shape (weights hot in cache), 32 to
                                              2,048 rows: where oneDNN's GEMM overtakes the AMX loop
       python tools/gemm_stream.py --prefill  one layer of each shape at 48 to 512 rows (prefill chunks):
                                              PyTorch's F.linear on bf16 against the model's own forms of
                                              bf16, int8 and int4-g128 (where bf16 has no GEMM: MKL's fp32
                                              GEMM on the widened or dequantized weight); the VNNI-block
                                              layers both dequantized to the dense GEMM and on their kernel
       python tools/gemm_stream.py --pages    the layer matmuls at 1 row, bf16, int8 and int4-g128 as the
                                              model holds them, on 4 KB pages against moved onto huge pages
       --dynamic-quant                        one layer of each shape at 2 to 2,048 rows, int4-g32 and int8: kvyard's
                                              int8-activation kernel (--dynamic-quant) against the portable kernel
                                              and MKL's fp32 GEMM on the dequantized weight
       --qwen                                 Qwen2.5-0.5B's layer shapes (24 layers) instead of SmolLM2's
       --kept                                 the low-bit forms keep 5 % of their input columns (outlier columns)
       --flush                                read a 600 MB buffer before each pass, so that every pass starts
                                              with none of its weights in cache (as a model stepped in turn does)
"""
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvyard.kernels import cpu as cpu_kernels
from kvyard.models.huge_pages import move_to_huge_pages, tensors_in
from kvyard.models.linear import VnniWeight, Weight, linear, pack_weight
from kvyard.quant.qlinear import (
    Int4Linear,
    Int8Linear,
    PlainLowBitLinear,
    VnniLowBitLinear,
    dequantized_linear,
    make_linear,
)
from kvyard.quant.qtensor import QuantizedTensor
from kvyard.quant.scheme import parse_weight_scheme

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down
HEAD = (49152, 576)
QWEN_SHAPES, QWEN_HEAD, QWEN_LAYERS = [(1152, 896), (896, 896), (9728, 896), (896, 4864)], (151936, 896), 24
Matmul = Callable[[torch.Tensor], torch.Tensor]


def onednn(d: torch.Tensor) -> Matmul:
    packed = torch.ops.mkldnn._reorder_linear_weight(d.bfloat16(), 32)
    return lambda x: linear(x, packed)


def model_form(d: torch.Tensor) -> Matmul:
    """The bf16 form the model itself takes here (AMX tiles, oneDNN's layout, or a plain matrix)."""
    w = pack_weight(d.bfloat16(), max_rows=512)
    return lambda x: linear(x, w)


def bf16_forms(dense: list[torch.Tensor]) -> dict[str, list[Matmul]]:
    forms: dict[str, list[Matmul]] = {"onednn": [onednn(d) for d in dense]}
    if cpu_kernels.amx_available() or cpu_kernels.dpbf16_available():
        forms["amx" if cpu_kernels.amx_available() else "dpbf16"] = [VnniWeight.tile(d.bfloat16()) for d in dense]
    return forms


KEPT = 0.05 if "--kept" in sys.argv else 0.0  # share of input columns kept beside the codes


def quantized(d: torch.Tensor, scheme: str) -> QuantizedTensor:
    cols = torch.randperm(d.shape[1], generator=torch.Generator().manual_seed(d.shape[1]))[: int(KEPT * d.shape[1])]
    return QuantizedTensor.quantize(d, parse_weight_scheme(scheme), cols if KEPT else None)


def lowbit_forms(dense: list[torch.Tensor]) -> dict[str, list[Matmul]]:
    forms: dict[str, list[Matmul]] = {"bf16": [model_form(d) for d in dense]}
    if not KEPT:  # PyTorch's and the portable kernels leave kept columns to a matmul beside them
        forms["int8 torch"] = [Int8Linear(quantized(d, "int8"), torch.bfloat16, torch.device("cpu")) for d in dense]
        forms["int4-g128 torch"] = [Int4Linear(quantized(d, "int4-g128"), torch.bfloat16, torch.device("cpu"))
                                    for d in dense]
    if cpu_kernels.available() and not KEPT:
        forms["int8 plain"] = [PlainLowBitLinear(quantized(d, "int8")) for d in dense]
        forms["int4-g128 plain"] = [PlainLowBitLinear(quantized(d, "int4-g128")) for d in dense]
    if cpu_kernels.amx_available() or cpu_kernels.vnni_lowbit_available():
        kind = "amx" if cpu_kernels.amx_available() else "vnni"
        forms[f"int8 {kind}"] = [VnniLowBitLinear(quantized(d, "int8")) for d in dense]
        forms[f"int4-g128 {kind}"] = [VnniLowBitLinear(quantized(d, "int4-g128")) for d in dense]
    return forms


def prefill_forms(dense: list[torch.Tensor]) -> dict[str, list[Matmul]]:
    forms = lowbit_forms(dense)
    plain = [d.bfloat16() for d in dense]
    vnni_layers = {name: f for name, f in forms.items() if name.endswith((" amx", " vnni"))}
    return {"bf16 F.linear": [lambda x, w=w: F.linear(x, w) for w in plain], "bf16": forms["bf16"],
            **{name: f for name, f in forms.items() if name.endswith(" plain")},
            **{f"{name} dequantized": [lambda x, w=w: dequantized_linear(w, x) for w in ws]
               for name, ws in vnni_layers.items()},
            **{f"{name} kernel": ws for name, ws in vnni_layers.items()}}  # the layers take every row count


def dynamic_quant_forms(dense: list[torch.Tensor]) -> dict[str, list[Matmul]]:
    if not cpu_kernels.int8_act_available():
        raise SystemExit("--dynamic-quant needs kvyard's AVX2 kernels, which this CPU or build lacks")
    forms: dict[str, list[Matmul]] = {}
    for scheme in ("int4-g32", "int8"):
        qts = [quantized(d, scheme) for d in dense]  # one rounding for all three forms
        exact = [PlainLowBitLinear(qt) for qt in qts]
        forms[f"{scheme} int8-activations"] = [PlainLowBitLinear(qt, int8_activations=True).kernel for qt in qts]
        forms[f"{scheme} portable"] = [w.kernel for w in exact]
        forms[f"{scheme} fp32 GEMM"] = [lambda x, w=w: dequantized_linear(w, x) for w in exact]
    return forms


def paged_forms(dense: list[torch.Tensor]) -> dict[str, list[Matmul]]:
    """bf16, int8 and int4-g128 in the model's forms, once as allocated (4 KB pages) and once moved onto huge pages."""
    forms: dict[str, list[Matmul]] = {}
    for pages in ("4 KB", "huge"):
        weights: dict[str, list[Weight]] = {"bf16": [pack_weight(d.bfloat16(), max_rows=512) for d in dense]}
        if cpu_kernels.available():
            for scheme in ("int8", "int4-g128"):
                weights[scheme] = [make_linear(quantized(d, scheme), torch.bfloat16, torch.device("cpu")) for d in dense]
        if pages == "huge":
            move_to_huge_pages(tensors_in(weights.values()))
        forms |= {f"{name} {pages}": [lambda x, w=w: linear(x, w) for w in ws] for name, ws in weights.items()}
    return forms


def rate(seconds: float, flops: int, bf16_bytes: int, prefill: bool) -> str:
    """Prefill chunks are compute-bound (GFLOP/s); decode matmuls stream their weights (GB/s)."""
    return f"{flops / seconds / 1e9:.0f} GFLOP/s" if prefill else f"{bf16_bytes / seconds / 1e9:.1f} GB/s of bf16"


def main() -> None:
    torch.set_num_threads(2)
    modes = ("lowbit", "hot", "prefill", "pages", "dynamic-quant")
    lowbit, hot, prefill, pages, dq = (f"--{m}" in sys.argv for m in modes)
    prefill = prefill or dq  # one layer of each shape, compute-bound
    layer, head, layers = (QWEN_SHAPES, QWEN_HEAD, QWEN_LAYERS) if "--qwen" in sys.argv else (SHAPES, HEAD, 30)
    shapes = layer if hot or prefill else layer * layers + ([] if lowbit or pages else [head])
    dense = [torch.randn(o, i) for o, i in shapes]
    forms = (dynamic_quant_forms(dense) if dq else prefill_forms(dense) if prefill else lowbit_forms(dense) if lowbit
             else paged_forms(dense) if pages else bf16_forms(dense))
    bf16_bytes = sum(d.numel() * 2 for d in dense)
    row_counts = ((2, 8, 32, 256, 2048) if dq else (48, 128, 512) if prefill else (32, 64, 128, 512, 2048) if hot
                  else (1, 32) if lowbit else (1,) if pages else (1, 16, 32, 64))
    for rows in row_counts:
        xs = {i: torch.randn(rows, i, dtype=torch.bfloat16) for i in {i for _, i in layer}}
        times: dict[str, list[float]] = {name: [] for name in forms}
        flush = torch.ones(150_000_000) if "--flush" in sys.argv else None
        for _ in range(7):
            for name, matmuls in forms.items():
                if flush is not None:
                    flush.sum()
                start = time.perf_counter()
                for f, d in zip(matmuls, dense, strict=True):
                    f(xs[d.shape[1]])
                times[name].append(time.perf_counter() - start)
        flops = sum(2 * rows * d.numel() for d in dense)
        cells = [f"{name} {statistics.median(t) * 1e3:.2f} ms ({rate(statistics.median(t), flops, bf16_bytes, prefill)})"
                 for name, t in times.items()]
        print(f"{rows} rows, {len(dense)} matmuls: " + ", ".join(cells))


if __name__ == "__main__":
    main()
