"""Write a tiny HF checkpoint as a GGUF file, the way llama.cpp's converter would.

The name mapping and the q/k permutation here are written independently of kvyard's loader, after
llama.cpp's `convert_hf_to_gguf.py`, so that the loader is checked against the converter's behaviour.
"""

import json
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, TokenType
from gguf.quants import quantize
from safetensors.numpy import load_file

Q = GGMLQuantizationType

_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
_GLOBAL["lm_head.weight"] = "output.weight"


# Mixture of Experts, after llama.cpp's converter: the router, each projection's experts stacked into one 3-D
# tensor, and qwen2moe's shared expert.
_MOE_LAYER = {
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}
_EXPERT_PROJ = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}
_MOE_ARCH = {"qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "mixtral": "llama"}


def stack_experts(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per-expert HF tensors (`...experts.{e}.{proj}.weight`) replaced by llama.cpp's `blk.N.ffn_{gate,up,down}_exps`."""
    out, stacks = {}, {}
    for name, t in state.items():
        parts = name.split(".")
        if "experts" in parts:
            layer, e, proj = parts[2], int(parts[parts.index("experts") + 1]), parts[-2]
            stacks.setdefault(f"blk.{layer}.ffn_{_EXPERT_PROJ[proj]}_exps.weight", {})[e] = t
        else:
            out[name] = t
    for gname, experts in stacks.items():
        out[gname] = np.stack([experts[e] for e in sorted(experts)])
    return out


def gguf_name(hf_name: str) -> str:
    if hf_name.startswith("blk."):  # already llama.cpp's (stacked experts)
        return hf_name
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_LAYER.get(rest) or _MOE_LAYER[rest]}"


def llama_cpp_permute(w: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute`: rotary halves -> interleaved pairs, per head."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def encode(w: np.ndarray, qtype: GGMLQuantizationType) -> tuple[np.ndarray, GGMLQuantizationType | None]:
    """The array to hand to GGUFWriter, and the raw dtype to declare (None: inferred from numpy)."""
    if qtype == Q.F32:
        return w.astype(np.float32), None
    if qtype == Q.F16:
        return w.astype(np.float16), None
    return quantize(w.astype(np.float32), qtype), qtype


def hf_state_dict(hf_dir: Path) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        out.update({k: v.astype(np.float32) for k, v in load_file(f).items()})
    return out


def _add_tokenizer(w: GGUFWriter, hf_dir: Path, cfg: dict) -> None:
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    special = {t["content"] for t in tok["added_tokens"] if t["special"]}
    vocab.update({t["content"]: t["id"] for t in tok["added_tokens"]})
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([TokenType.CONTROL if t in special else TokenType.NORMAL for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_pad_token_id(cfg["pad_token_id"])
    tok_cfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    template = tok_cfg.get("chat_template")
    if template is None and (hf_dir / "chat_template.jinja").exists():
        template = (hf_dir / "chat_template.jinja").read_text()
    w.add_chat_template(template)


def write_tiny_gguf(
    hf_dir: Path,
    out: Path,
    qtype: GGMLQuantizationType = Q.F32,
    arch: str | None = None,
    drop: tuple[str, ...] = (),
    replace: dict[str, np.ndarray] | None = None,
    qtypes: dict[str, GGMLQuantizationType] | None = None,
    metadata: dict[str, float | int] | None = None,
) -> Path:
    """Convert `hf_dir` to `out`. 2-D weights get `qtype` (`qtypes`: another type for some, by GGUF name); norms
    stay F32 as llama.cpp keeps them.

    `drop` names GGUF tensors to leave out; `replace` gives GGUF tensors to write instead, as is. `metadata`:
    more keys (floats as float32, ints as int32, e.g. `general.sampling.*`).
    """
    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = arch or _MOE_ARCH.get(cfg["model_type"], cfg["model_type"])
    w = GGUFWriter(out, arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg.get("rope_parameters") or {}
    w.add_rope_freq_base(float(cfg.get("rope_theta") or rope.get("rope_theta", 10000.0)))
    w.add_vocab_size(cfg["vocab_size"])
    if cfg.get("head_dim"):
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
        if cfg.get("shared_expert_intermediate_size"):
            w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    _add_tokenizer(w, hf_dir, cfg)
    for key, value in (metadata or {}).items():
        (w.add_int32 if isinstance(value, int) else w.add_float32)(key, value)
    for hf, t in stack_experts(hf_state_dict(hf_dir)).items():
        name = gguf_name(hf)
        if name in drop:
            continue
        if replace and name in replace:
            w.add_tensor(name, replace[name])
            continue
        if arch == "llama" and name.endswith("attn_q.weight"):
            t = llama_cpp_permute(t, cfg["num_attention_heads"])
        elif arch == "llama" and name.endswith("attn_k.weight"):
            t = llama_cpp_permute(t, cfg["num_attention_heads"], cfg["num_key_value_heads"])
        if name.endswith("ffn_gate_inp_shexp.weight"):
            t = t.reshape(-1)  # llama.cpp keeps the shared expert's gate as a vector
        data, raw = encode(t, (qtypes or {}).get(name, qtype) if t.ndim >= 2 else Q.F32)
        w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
