"""A decode step's decoder layers in one C++ call (csrc/decode_stack.cpp), where every weight has a kvyard kernel.

A batch-1 step on CPU runs ~10 small kernels per layer; calling them one by one from Python cost about as much
as the kernels themselves outside the matmuls (~2.5 ms of an ~11 ms SmolLM2 step on a 2-core AMD EPYC). The
C++ stack makes the same calls in the same order, so its outputs are bit-identical to `DecoderModel.run_layer`.

It takes steps of decodes only (their rows with or without LoRA adapters), up to FUSED_MAX_ROWS rows, on CPU in
fp32 or bf16, and only where each weight is one of the forms below; anything else (prefill chunks,
oneDNN-packed weights, GPUs) runs layer by layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvyard.kernels import cpu as cpu_kernels
from kvyard.models import linear as linear_mod
from kvyard.models.linear import RowInvariantWeight, VnniWeight, Weight
from kvyard.quant.qlinear import PlainLowBitLinear, VnniLowBitLinear

if TYPE_CHECKING:
    from kvyard.models.attention import AttentionMetadata
    from kvyard.models.decoder import DecoderModel
    from kvyard.models.kv_layer import LayerKV

# Up to this many rows every form below takes the kernel `linear()` gives it (plain bf16 weights switch to the
# fp32 GEMM past FEW_ROWS), so the stack and the layer-by-layer path agree exactly.
FUSED_MAX_ROWS = linear_mod.FEW_ROWS
# csrc/decode_stack.cpp's Kind
DPBF16, AMX, LOW_BIT, AMX_LOW_BIT, LINEAR_BF16, DENSE, VNNI_LOW_BIT, LOW_BIT_I8 = range(8)

STACK_PROJECTIONS = ("qkv", "o", "gate_up", "down")  # csrc/decode_stack.cpp's Layer::lora order
# kind, (weight, scale, zero, bias, outlier_cols, outliers), (bits, group, out_features, k_pad)
LinearSpec = tuple[int, list[torch.Tensor | None], list[int]]


def linear_spec(w: Weight, bias: torch.Tensor | None, dtype: torch.dtype) -> LinearSpec | None:
    """How the C++ stack multiplies by `w` for a few rows, as `linear(x, w, bias)` does; None where it cannot."""
    none = [0, 0, 0, 0]
    if isinstance(w, VnniWeight):
        return (AMX if cpu_kernels.amx_available() else DPBF16), [w.blocks, None, None, bias, None, None], none
    if isinstance(w, RowInvariantWeight):  # the batch-invariant path: the same kernel as the layer-by-layer one
        return LINEAR_BF16, [w.weight, None, None, bias, None, None], none
    if isinstance(w, PlainLowBitLinear):
        return (LOW_BIT_I8 if w.int8_activations else LOW_BIT), [w.q, w.scale, w.zero, bias, None, None], [w.bits, w.group_size, w.out_features, w.k_pad]
    if isinstance(w, VnniLowBitLinear) and dtype == torch.bfloat16:
        kind = AMX_LOW_BIT if cpu_kernels.amx_available() else VNNI_LOW_BIT
        return kind, [w.q, w.scale, w.zero, bias, w.outlier_cols, w.outliers], [w.bits, w.group_size, w.out_features, 0]
    if isinstance(w, torch.Tensor) and w.layout == torch.strided and not w.is_mkldnn and w.dtype == dtype:
        if dtype == torch.float32:
            return DENSE, [w, None, None, bias, None, None], none
        if w.is_contiguous() and linear_mod.plain_bf16_cpu():
            return LINEAR_BF16, [w, None, None, bias, None, None], none
    return None  # e.g. a layer with outlier columns on a kernel that does not add them (OutlierColumns)


def build_decode_stack(model: DecoderModel) -> torch.ScriptObject | None:
    """The model's layers as a DecodeStack, or None where some weight (or the device) has no kernel here."""
    cfg = model.cfg
    if model.device.type != "cpu" or model.dtype not in (torch.float32, torch.bfloat16) or not cpu_kernels.available():
        return None
    if cfg.num_experts or cfg.qk_norm_whole or cfg.clip_qkv is not None:  # steps the C++ stack does not take
        return None
    stack = torch.classes.kvyard.DecodeStack(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps)
    for layer in model.layers:
        specs = [linear_spec(layer.qkv, layer.qkv_bias, model.dtype), linear_spec(layer.o, None, model.dtype),
                 linear_spec(layer.gate_up, None, model.dtype), linear_spec(layer.down, None, model.dtype)]
        if any(s is None for s in specs):
            return None
        stack.add_layer(layer.input_norm, layer.post_norm, layer.qk_norm, layer.qk_scale, [s[0] for s in specs],
                        [t for s in specs for t in s[1]], [i for s in specs for i in s[2]])
    for i, layer in enumerate(model.layers):  # the loaded LoRA adapters (a load or unload rebuilds the stack)
        for p, projection in enumerate(STACK_PROJECTIONS):
            lora = (layer.lora or {}).get(projection)
            if lora is not None:
                stack.set_lora(i, p, lora.a, lora.b, lora.used, lora.rank, lora.part_offsets)
    return stack


def takes_step(x: torch.Tensor, meta: AttentionMetadata, caches: list[LayerKV]) -> bool:
    """Whether this step is one the stack runs: decodes only, few rows, caches the fused RoPE kernel writes."""
    return (not meta.prefills and meta.decode_blocks is not None and 0 < x.shape[0] <= FUSED_MAX_ROWS
            and all(c.quantized or c.k.dtype == x.dtype for c in caches))


def run_decode_stack(stack: torch.ScriptObject, x: torch.Tensor, meta: AttentionMetadata, caches: list[LayerKV],
                     cos: torch.Tensor, sin: torch.Tensor, lora_slots: torch.Tensor | None = None,
                     dp_attention: bool = False) -> None:
    """`lora_slots`: each decode row's LoRA adapter slot (-1: the base model), None when no row has one;
    `dp_attention`: a bf16 cache's decodes in a prompt token's arithmetic (attention.rows_attention's lone_rows)."""
    stack.forward(x, cos, sin, [c.k for c in caches], [c.v for c in caches], [c.k_scale for c in caches],
                  [c.v_scale for c in caches], meta.slot_mapping, meta.decode_blocks, meta.decode_lens,
                  meta.block_size, lora_slots, dp_attention)
