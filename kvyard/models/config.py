"""The model shape kvyard needs, read from an HF `config.json` dict (GGUF metadata is mapped to it)."""

from dataclasses import dataclass, field
from typing import Any

from kvyard.errors import CheckpointError, UnsupportedArchitectureError

# model_type -> the architecture switches our decoder implements.
SUPPORTED_MODEL_TYPES = {
    "llama": {"attention_bias": False, "qk_norm": False},
    "mistral": {"attention_bias": False, "qk_norm": False},
    "qwen2": {"attention_bias": True, "qk_norm": False},
    "qwen3": {"attention_bias": False, "qk_norm": True},
    "gemma3_text": {"attention_bias": False, "qk_norm": True},
    # Mixture-of-Experts families (kvyard/models/moe.py)
    "qwen2_moe": {"attention_bias": True, "qk_norm": False},
    "qwen3_moe": {"attention_bias": False, "qk_norm": True},
    "mixtral": {"attention_bias": False, "qk_norm": False},
    "olmoe": {"attention_bias": False, "qk_norm": False},  # its q/k norms span the whole projection
    # Multi-head latent attention with routed and shared experts (kvyard/models/deepseek.py)
    "deepseek_v2": {"attention_bias": False, "qk_norm": False},
    "deepseek_v3": {"attention_bias": False, "qk_norm": False},
}
MOE_MODEL_TYPES = ("qwen2_moe", "qwen3_moe", "mixtral", "olmoe")
MLA_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")
GEMMA3_ACTIVATION = "gelu_pytorch_tanh"


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    rope_scaling: dict[str, Any] | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # Per layer: the sliding window (a query sees keys fewer than this many positions behind it), or None for
    # full attention; empty when no layer slides.
    layer_windows: tuple[int | None, ...] = ()
    # Sliding layers also see the first this many positions (attention sinks, as StreamingLLM keeps them); a
    # kvyard key of retrofitted checkpoints (`kvyard retrofit --sinks`), which HF does not read
    sliding_window_sinks: int = 0
    local_rope_theta: float | None = None  # Gemma 3's sliding layers rotate with a base of their own
    query_pre_attn_scalar: float | None = None  # attention scales by its -1/2 power; None: head_dim's
    final_logit_softcapping: float | None = None  # logits = c * tanh(logits / c)
    # Mixture of Experts: which layers route (True) or keep a dense MLP; experts' sizes and the router's rule
    sparse_layers: tuple[bool, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0  # qwen2_moe
    # Expert parallelism (kvyard/parallel/expert.py): the experts of each layer this rank holds; empty: all
    held_experts: tuple[int, ...] = ()
    qk_norm_whole: bool = False  # olmoe: RMSNorm over all of q's (and of k's) heads at once
    clip_qkv: float | None = None  # olmoe: q, k and v clamped to [-c, c]
    # DeepSeek's routers: sigmoid scores (v3, with a learned bias for the choice) or softmax; experts chosen only
    # within the best `router_topk_groups` of `router_groups` groups; weights times routed_scaling_factor; an
    # ungated shared expert
    router_scoring: str = "softmax"
    router_groups: int = 1
    router_topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    shared_expert_gated: bool = True
    # Multi-head latent attention (deepseek_v2 / v3): the cache holds a latent of kv_lora_rank values and one
    # rotary key of head_dim (= qk_rope_head_dim) per token; queries come through a rank-q_lora_rank bottleneck
    kv_lora_rank: int = 0
    q_lora_rank: int = 0  # 0: q straight from the hidden state
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # the checkpoint's rotary dimensions come in (x0, x1) pairs
    # DeepSeek with YaRN (mscale_all_dim): its softmax scale times this twice, as transformers applies it
    attention_mscale: float = 1.0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    def is_sparse(self, layer: int) -> bool:
        return bool(self.sparse_layers) and self.sparse_layers[layer]

    @property
    def attention_scale(self) -> float | None:
        """Attention's scale where it is not head_dim ** -0.5 (None: that default)."""
        if self.query_pre_attn_scalar is None and self.attention_mscale == 1.0:
            return None
        base = float(self.query_pre_attn_scalar or self.head_dim) ** -0.5
        return base * self.attention_mscale * self.attention_mscale

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            archs = cfg.get("architectures") or [model_type]
            raise UnsupportedArchitectureError(
                f"{source}: architecture {archs} (model_type={model_type!r}) is not supported; "
                f"kvyard implements {sorted(SUPPORTED_MODEL_TYPES)}"
            )
        required = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"]
        missing = [k for k in required if k not in cfg]
        if missing:
            raise CheckpointError(f"{source}: {model_type} config is missing {missing}")
        flags = SUPPORTED_MODEL_TYPES[model_type]
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        rope_theta = cfg.get("rope_theta")
        rope_scaling = cfg.get("rope_scaling")
        # transformers 5 folds rope settings into `rope_parameters`.
        rope_params = cfg.get("rope_parameters") or {}
        if rope_theta is None:
            rope_theta = rope_params.get("rope_theta", 10000.0)
        if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
            rope_scaling = rope_params
        num_layers = int(cfg["num_hidden_layers"])
        family: dict[str, Any] = {}  # the fields only some families set
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", model_type == "mistral") else None
        if model_type == "gemma3_text":
            family = _gemma3_fields(cfg, source, num_layers)
            rope_theta, rope_scaling = family.pop("rope_theta"), family.pop("rope_scaling")
        elif window:
            family["layer_windows"] = _sliding_layers(cfg, model_type, int(window), num_layers)
            family["sliding_window_sinks"] = int(cfg.get("sliding_window_sinks") or 0)
        if model_type in MOE_MODEL_TYPES:
            family.update(_moe_fields(cfg, model_type, num_layers))
        if model_type in MLA_MODEL_TYPES:
            family.update(_deepseek_fields(cfg, model_type, num_layers, source, rope_scaling or {}))
        return cls(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=family.pop("head_dim", None) or int(cfg.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", model_type == "gemma3_text")),
            attention_bias=bool(cfg.get("attention_bias", flags["attention_bias"])),
            qk_norm=flags["qk_norm"],
            rope_scaling=rope_scaling,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            **family,
        )


def _sliding_layers(cfg: dict[str, Any], model_type: str, window: int, num_layers: int) -> tuple[int | None, ...]:
    """Which layers slide, as HF reads it: `layer_types` where given; else qwen2's layers from max_window_layers
    on; else (mistral) every layer."""
    kinds = cfg.get("layer_types")
    if kinds is None and model_type == "qwen2":
        first = int(cfg.get("max_window_layers", 28))
        kinds = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    if kinds is None:
        return (window,) * num_layers
    return tuple(window if k == "sliding_attention" else None for k in kinds)


def _gemma3_fields(cfg: dict[str, Any], source: str, num_layers: int) -> dict[str, Any]:
    """Gemma 3's layer kinds, RoPE bases and scales, from either config layout (transformers 4's rope_theta and
    rope_local_base_freq, or 5's rope_parameters per layer kind)."""
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or GEMMA3_ACTIVATION
    if act != GEMMA3_ACTIVATION or cfg.get("attn_logit_softcapping") is not None:
        raise UnsupportedArchitectureError(
            f"{source}: gemma3 with hidden_activation={act!r} and attn_logit_softcapping="
            f"{cfg.get('attn_logit_softcapping')!r}; kvyard implements {GEMMA3_ACTIVATION!r} and no attention softcap")
    pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
    kinds = cfg.get("layer_types") or ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                                       for i in range(num_layers)]
    window = int(cfg.get("sliding_window") or 512)
    per_kind = cfg.get("rope_parameters") or {}
    full, local = per_kind.get("full_attention") or {}, per_kind.get("sliding_attention") or {}
    scaling = cfg.get("rope_scaling") or (full if full.get("rope_type", "default") != "default" else None)
    return {
        "layer_windows": tuple(window if k == "sliding_attention" else None for k in kinds),
        "rope_theta": float(full.get("rope_theta") or cfg.get("rope_theta") or 1_000_000.0),
        "rope_scaling": scaling,
        "local_rope_theta": float(local.get("rope_theta") or cfg.get("rope_local_base_freq") or 10_000.0),
        "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar") or 256),
        "final_logit_softcapping": cfg.get("final_logit_softcapping"),
    }


def _moe_fields(cfg: dict[str, Any], model_type: str, num_layers: int) -> dict[str, Any]:
    """The routing layout of an MoE config, as transformers reads it for each family."""
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    dense = set(cfg.get("mlp_only_layers") or ())
    step = int(cfg.get("decoder_sparse_step") or 1)
    return {
        "sparse_layers": tuple(experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(num_layers)),
        "num_experts": experts,
        "num_experts_per_tok": int(cfg.get("num_experts_per_tok") or 2),
        # Mixtral's and OLMoE's experts are intermediate_size wide; the Qwen MoEs' have a size of their own.
        "moe_intermediate_size": int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
        "norm_topk_prob": True if model_type == "mixtral" else bool(cfg.get("norm_topk_prob", False)),
        "shared_expert_intermediate_size": int(cfg.get("shared_expert_intermediate_size") or 0)
        if model_type == "qwen2_moe" else 0,
        "qk_norm_whole": model_type == "olmoe",
        "clip_qkv": cfg.get("clip_qkv") if model_type == "olmoe" else None,
    }


def _deepseek_fields(cfg: dict[str, Any], model_type: str, num_layers: int, source: str, rope_scaling: dict[str, Any]
                     ) -> dict[str, Any]:
    """DeepSeek V2 / V3: the latent attention's sizes and the routers, as transformers reads them."""
    from kvyard.models.rope import yarn_mscale

    mscale = 1.0
    if rope_scaling.get("rope_type", rope_scaling.get("type", "default")) != "default" and rope_scaling.get(
            "mscale_all_dim"):
        mscale = yarn_mscale(float(rope_scaling["factor"]), float(rope_scaling["mscale_all_dim"]))
    if cfg.get("attention_bias"):
        raise UnsupportedArchitectureError(f"{source}: {model_type} with attention_bias; kvyard implements none")
    v3 = model_type == "deepseek_v3"
    nope, rope = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"])
    experts = int(cfg.get("n_routed_experts") or 0)
    first_dense = int(cfg.get("first_k_dense_replace") or 0)
    grouped = v3 or cfg.get("topk_method") == "group_limited_greedy"
    moe_size = int(cfg.get("moe_intermediate_size") or 0)
    return {
        "kv_lora_rank": int(cfg["kv_lora_rank"]),
        "q_lora_rank": int(cfg.get("q_lora_rank") or 0),
        "qk_nope_head_dim": nope,
        "v_head_dim": int(cfg["v_head_dim"]),
        "head_dim": rope,
        # v2 rotates (x0, x1) pairs as complex numbers; v3 too unless told otherwise
        "rope_interleave": bool(cfg.get("rope_interleave", True)) if v3 else True,
        "query_pre_attn_scalar": float(nope + rope),
        "attention_mscale": mscale,
        "sparse_layers": tuple(experts > 0 and i >= first_dense for i in range(num_layers)),
        "num_experts": experts,
        "num_experts_per_tok": int(cfg.get("num_experts_per_tok") or 1),
        "moe_intermediate_size": moe_size,
        "norm_topk_prob": v3 and bool(cfg.get("norm_topk_prob", True)),  # v2's router never renormalises
        "shared_expert_intermediate_size": moe_size * int(cfg.get("n_shared_experts") or 0),
        "shared_expert_gated": False,
        "router_scoring": "sigmoid" if v3 else "softmax",
        "router_groups": int(cfg.get("n_group") or 1) if grouped else 1,
        "router_topk_groups": int(cfg.get("topk_group") or 1) if grouped else 1,
        "routed_scaling_factor": float(cfg.get("routed_scaling_factor") or 1.0),
    }
