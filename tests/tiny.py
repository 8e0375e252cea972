"""Tiny random HF checkpoints, built on the fly, so tests have a reference model in every architecture."""

from functools import cache
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 4,
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n",
    "Paged attention keeps the KV cache in fixed-size blocks. Continuous batching admits requests every step.",
    "Zwölf Boxkämpfer jagen Viktor quer über den großen Sylter Deich. 日本語のテキストも少し。 émoji 🙂🚀",
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
]

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@cache
def tiny_tokenizer_json() -> str:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    return tok.to_str()


def save_tiny_tokenizer(out: Path) -> transformers.PreTrainedTokenizerFast:
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(tiny_tokenizer_json()),
        eos_token="<|im_end|>",
        bos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(out)
    return tok


ARCH_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM"),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
}
# Mixture-of-Experts families in small: 4 experts, top-2, routers of each kind (renormalised top-k or not), a
# dense first layer (qwen2_moe's mlp_only_layers), qwen2_moe's gated shared expert, OLMoE's q/k/v clipping.
MOE_TINY = {
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, mlp_only_layers=[0], norm_topk_prob=False),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16,
                      norm_topk_prob=True),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2, clip_qkv=6.0, norm_topk_prob=False),
}
# DeepSeek in small: latent attention (v2 with q straight from the hidden state, v3 through its low-rank
# bottleneck), a dense first layer, 4 routed experts in 2 groups of which 1 is chosen, one shared expert.
_DEEPSEEK = dict(num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                 n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                 first_k_dense_replace=1, n_group=2, topk_group=1)
MOE_TINY["deepseek_v2"] = dict(_DEEPSEEK, q_lora_rank=None, topk_method="group_limited_greedy")
MOE_TINY["deepseek_v3"] = dict(_DEEPSEEK, q_lora_rank=48, routed_scaling_factor=2.5)
# Gemma 3 in small: three layers, two of them sliding with a window shorter than most test prompts and not a
# multiple of any block size used, and a query scale other than head_dim's.
GEMMA3_TINY = dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=7, num_hidden_layers=3,
                   layer_types=["sliding_attention", "sliding_attention", "full_attention"])


# Variants of a family under a name of their own: (model_type, config overrides).
VARIANTS = {
    "mistral-sliding": ("mistral", dict(sliding_window=7)),
    # YaRN: long-context frequencies, cos and sin scaled, and DeepSeek's softmax scale by mscale_all_dim
    "qwen2-yarn": ("qwen2", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                               "original_max_position_embeddings": 128})),
    "deepseek_v3-yarn": ("deepseek_v3", dict(rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 32,
        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8})),
}


def make_tiny_checkpoint(
    out: Path,
    model_type: str = "llama",
    tie_word_embeddings: bool = False,
    seed: int = 0,
    num_layers: int = 2,
    max_shard_size: str | None = None,
    **overrides,
) -> Path:
    """Write a random model with the tiny tokenizer to `out`; return `out`."""
    out.mkdir(parents=True, exist_ok=True)
    tok = save_tiny_tokenizer(out)
    model_type, variant = VARIANTS.get(model_type, (model_type, {}))
    overrides = {**variant, **overrides}
    cfg_cls, model_cls = (getattr(transformers, n) for n in ARCH_CLASSES[model_type])
    kwargs = dict(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        rms_norm_eps=1e-5,
    )
    if model_type == "qwen3":
        kwargs["head_dim"] = 16
    if model_type == "gemma3_text":
        kwargs.update(GEMMA3_TINY)
    kwargs.update(MOE_TINY.get(model_type, {}))
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**kwargs)).eval()
    # Random init gives near-uniform logits; scale the weights up so greedy choices are well separated.
    # Biases (qwen2's q/k/v) start at zero: give them values, so that a path that drops one shows.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(0.5 * torch.randn_like(p))
            elif "norm" not in name:
                p.mul_(4.0 if "embed" in name or "lm_head" in name else 2.0)
            elif p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # deepseek_v3's choice bias starts at zero
                b.copy_(0.1 * torch.randn_like(b))
    save_kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **save_kwargs)
    return out
