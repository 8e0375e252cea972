"""What a model needs in memory, computed from its ModelConfig with the engine's own sizing (#38).

Weights: the parameters of every tensor the engine loads (the linear units kvyard quantizes, the experts, the
embedding, the norms), each linear one in the chosen weight format with its scales. KV: the engine's own
`bytes_per_block` (kvyard/engine/kv_cache.py), so a model's latent cache, int8 KV or sliding-window layers
are sized as the engine sizes them; there is no second formula to drift. A model that is not on disk is
described by its parameter count and attention shape (`described_config`).
"""

import math
from dataclasses import dataclass

import torch

from kvyard.engine.kv_cache import bytes_per_block
from kvyard.errors import ConfigError
from kvyard.models.config import ModelConfig
from kvyard.quant.plan import expert_units, linear_units

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class WeightFormat:
    """Bytes per weight: `bits` per value, plus `scale_bytes` for every `group` values (0: no scales)."""

    name: str
    bits: float
    group: int = 0
    scale_bytes: int = 0

    def bytes(self, params: int) -> float:
        scales = math.ceil(params / self.group) * self.scale_bytes if self.group else 0
        return params * self.bits / 8 + scales

    def scale_bytes_of(self, params: int) -> float:
        return self.bytes(params) - params * self.bits / 8


# kvyard's own formats store a float32 scale per output channel (int8) or per group (int4); NVFP4 is 4-bit
# E2M1 values with an FP8 E4M3 scale per 16 (and one float32 per tensor, negligible); MXFP4 an E8M0 per 32.
WEIGHT_FORMATS = {f.name: f for f in (
    WeightFormat("float32", 32), WeightFormat("bfloat16", 16), WeightFormat("float16", 16), WeightFormat("fp8", 8),
    WeightFormat("int8", 8), WeightFormat("int4-g32", 4, 32, 4), WeightFormat("int4-g64", 4, 64, 4),
    WeightFormat("int4-g128", 4, 128, 4), WeightFormat("nvfp4", 4, 16, 1), WeightFormat("mxfp4", 4, 32, 1),
)}


def weight_format(name: str) -> WeightFormat:
    if name not in WEIGHT_FORMATS:
        raise ConfigError(f"unknown weight format {name!r}; known: {', '.join(WEIGHT_FORMATS)}", param="weights")
    return WEIGHT_FORMATS[name]


@dataclass
class ModelSize:
    linear_params: int  # the quantizable matrices (attention, MLPs, experts, the LM head)
    other_params: int  # embedding (when not tied to the head), norms, routers: kept at the compute dtype

    @property
    def params(self) -> int:
        return self.linear_params + self.other_params


def model_size(cfg: ModelConfig) -> ModelSize:
    """The parameters of the tensors the engine loads for `cfg`."""
    linear = sum(u.params for u in linear_units(cfg) + expert_units(cfg))
    h = cfg.hidden_size
    other = cfg.vocab_size * h if not cfg.tie_word_embeddings else 0  # the head is counted as a linear unit
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_layer = layer_norm_params(cfg)
    if cfg.qk_norm:  # held per head, for every head (the engine expands a per-head-dim weight)
        per_layer += q + kv
    if cfg.attention_bias:
        per_layer += q + 2 * kv
    other += cfg.num_layers * per_layer + h  # and the final norm
    for i in range(cfg.num_layers):
        if cfg.is_sparse(i):
            other += h * cfg.num_experts  # the router
            shared = cfg.shared_expert_intermediate_size
            other += 3 * h * shared + (h if shared and cfg.shared_expert_gated else 0)
    return ModelSize(linear, other)


def layer_norm_params(cfg: ModelConfig) -> int:
    """A layer's norms around attention and the MLP (Gemma 3 has four)."""
    return (4 if cfg.model_type.startswith("gemma3") else 2) * cfg.hidden_size


def kv_bytes_per_token(cfg: ModelConfig, kv_dtype: str, compute_dtype: torch.dtype) -> int:
    """Every layer's KV for one token, as the engine allocates it."""
    return bytes_per_block(cfg, 1, compute_dtype, kv_dtype)


def kv_bytes(cfg: ModelConfig, tokens: int, kv_dtype: str, compute_dtype: torch.dtype) -> int:
    """One sequence of `tokens`: a sliding-window layer holds at most its window."""
    per_layer = kv_bytes_per_token(cfg, kv_dtype, compute_dtype) // cfg.num_layers
    windows = cfg.layer_windows or (None,) * cfg.num_layers
    return sum(per_layer * (tokens if w is None else min(tokens, w)) for w in windows)


@dataclass
class MemoryBreakdown:
    weights: float  # bytes resident, with the scales and any second copy the kernels keep
    weights_read: float  # bytes a decode step streams: each weight once, in the form its kernel reads
    weight_scales: float
    kv_per_token: int
    kv_total: float  # at the target context and concurrency
    activations: float  # one step's hidden states and logits at max_num_batched_tokens, and workspace
    # Of `weights`, the norms, which every tensor rank holds whole: the layers' and the final one (on the last stage)
    norms: float = 0.0
    final_norm: float = 0.0
    # Of `weights`, what only a pipeline's first stage holds (the input embedding) and what only its last
    # holds beyond that (the packed copies of the head, and the head itself where it is not the embedding)
    embedding: float = 0.0
    head: float = 0.0

    @property
    def total(self) -> float:
        return self.weights + self.kv_total + self.activations


def breakdown(cfg: ModelConfig, weights: WeightFormat, context: int, concurrency: int, kv_dtype: str = "auto",
              compute_dtype: str = "bfloat16", batched_tokens: int = 2048,
              size: ModelSize | None = None, packed_copies: int = 0) -> MemoryBreakdown:
    """`size`: the model's parameters when known otherwise than from `cfg` (a described model).
    `packed_copies`: the rearranged copies the engine keeps of each dense weight on the target CPU
    (kvyard.models.linear.packed_copies): they replace a layer's matrices, and sit beside the head's, which
    the embedding (or the unpacked head) still needs."""
    dtype = DTYPES[compute_dtype]
    size = size or model_size(cfg)
    dense = WEIGHT_FORMATS[compute_dtype]
    weight_bytes = step_bytes = weights.bytes(size.linear_params) + dense.bytes(size.other_params)
    # a tied head is the embedding, a linear unit in the weights' format (model_size)
    embedding = (weights if cfg.tie_word_embeddings else dense).bytes(cfg.vocab_size * cfg.hidden_size)
    head = 0.0 if cfg.tie_word_embeddings else weights.bytes(cfg.vocab_size * cfg.hidden_size)
    if packed_copies and weights.name == compute_dtype:
        packed_head = dense.bytes(cfg.vocab_size * cfg.hidden_size)
        weight_bytes += (packed_copies - 1) * (weights.bytes(size.linear_params) - packed_head) + \
            packed_copies * packed_head
        head += packed_copies * packed_head
    # A step's activations: a few hidden-sized rows and the MLP's widest intermediate per batched token, and
    # float32 logits for the rows that sample (at most one per sequence).
    inter = max(cfg.intermediate_size, cfg.moe_intermediate_size * max(cfg.num_experts_per_tok, 1))
    activations = batched_tokens * (4 * cfg.hidden_size + 2 * inter) * dtype.itemsize
    activations += concurrency * cfg.vocab_size * 4
    return MemoryBreakdown(weight_bytes, step_bytes, weights.scale_bytes_of(size.linear_params),
                           kv_bytes_per_token(cfg, kv_dtype, dtype),
                           concurrency * kv_bytes(cfg, context, kv_dtype, dtype), activations,
                           dense.bytes(cfg.num_layers * layer_norm_params(cfg) + cfg.hidden_size),
                           dense.bytes(cfg.hidden_size), embedding, head)
