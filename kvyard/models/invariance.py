"""Where batch invariance comes at no cost, so that it is on by default (EngineConfig.batch_invariant None).

The batch-invariant path (--batch-invariant) keeps one summation order per output whatever shares a call: weights
in a row-invariant form (linear.row_invariant) and every prompt token attended as a decode row. On a CPU with
AVX512-BF16 and without AMX the default path already is that path for a dense bf16 model and for low-bit VNNI
blocks (--quantization gguf): pack_weight gives the same VNNI blocks as row_invariant (csrc/dpbf16_linear.cpp and
csrc/vnni_lowbit.cpp take one chain per output at any row count), and the paged kernel's prompt tiles attend each
prompt token as a row over its own prefix. There the engine switches the
path on, and says so. Elsewhere the invariant kernels cost throughput (BENCHMARKS.md), so it stays opt-in.
"""

from kvyard.kernels import cpu as cpu_kernels
from kvyard.models.attention import prompt_tiles_fit
from kvyard.models.config import ModelConfig
from kvyard.models.linear import keeps_row_order


def model_gap(cfg: ModelConfig) -> str | None:
    """The layers of this model that the batch-invariant path does not cover yet, or None: it runs dense layers
    with full attention, and the rest have kernels of their own."""
    if any(w is not None for w in cfg.layer_windows):
        return "sliding-window attention"
    if cfg.num_experts:
        return "Mixture-of-Experts layers"
    if cfg.kv_lora_rank:
        return "latent attention"
    return None


def invariant_by_default(model) -> bool:
    """Whether the loaded `model`'s default path keeps each row's sums in one order (see the module's doc):
    every projection and the head in a form whose kernel does (linear.keeps_row_order), and prompt tiles that
    fit. The head is packed here, once, as the first step would pack it."""
    cfg = model.cfg
    if not (cpu_kernels.available() and prompt_tiles_fit(cfg.head_dim, cfg.num_heads // cfg.num_kv_heads)):
        return False
    projections = [w for layer in model.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    return all(keeps_row_order(w) for w in projections) and keeps_row_order(model._head())
