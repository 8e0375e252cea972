"""Open a llama.cpp GGUF file as a Checkpoint: metadata -> HF config, tensors dequantized to float32.

GGUF stores tensors under llama.cpp names (`blk.3.attn_q.weight`) with dimensions listed fastest-moving
first; numpy views from `GGUFReader` are already in torch order, so a weight comes out as (out, in)
like HF's. llama.cpp's converter permutes the rows of the llama q/k projections (rotary pairs
interleaved instead of split in halves); `unpermute_qk` undoes that so weights equal HF's exactly.
"""

import functools
import hashlib
import os
import re
import tempfile
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, ReaderTensor
from gguf.quants import dequantize

from kvyard.errors import CheckpointError, UnsupportedArchitectureError
from kvyard.loader.checkpoint import Checkpoint
from kvyard.loader.generation_defaults import from_gguf_metadata
from kvyard.loader.gguf_native import SCHEMES, read_native
from kvyard.loader.hf_dir import check_tensor_names, expected_tensor_names
from kvyard.models.config import ModelConfig
from kvyard.quant.plan import linear_units
from kvyard.quant.qtensor import QuantizedTensor

# GGUF `general.architecture` -> (HF model_type, HF architecture class).
GGUF_ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
    "qwen2moe": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
}  # not olmoe: transformers, which builds kvyard's GGUF tokenizers, does not read its files
# llama.cpp's MoE graphs renormalise the chosen experts' weights for these architectures (Mixtral is `llama`
# with experts); `{arch}.expert_weights_norm` overrides where a file has it.
_NORM_TOPK = {"llama": True, "qwen3moe": True, "qwen2moe": False}
# Architectures whose converter applies llama.cpp's q/k row permutation.
_PERMUTED_QK = {"llama"}

_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # MoE layers: the router and qwen2moe's shared expert; each projection's experts stacked in one 3-D tensor
    # (`ffn_gate_exps`: [experts, out, in] in torch order), split into HF's per-expert tensors (`{e}`) by _stream.
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_exps": "mlp.experts.{e}.gate_proj",
    "ffn_up_exps": "mlp.experts.{e}.up_proj",
    "ffn_down_exps": "mlp.experts.{e}.down_proj",
}
# Families whose HF names differ, by HF model type (Mixtral's GGUF architecture is `llama`, so the model type
# the metadata gives, not the architecture, decides). Gemma 3: ffn_norm is the norm before the MLP, and two
# more norm the attention's and the MLP's outputs. Mixtral: block_sparse_moe, and w1 / w3 / w2.
_LAYER_TENSORS_BY_TYPE = {
    "gemma3_text": {**_LAYER_TENSORS, "ffn_norm": "pre_feedforward_layernorm",
                    "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"},
    "mixtral": {**_LAYER_TENSORS, "ffn_gate_inp": "block_sparse_moe.gate",
                "ffn_gate_exps": "block_sparse_moe.experts.{e}.w1", "ffn_up_exps": "block_sparse_moe.experts.{e}.w3",
                "ffn_down_exps": "block_sparse_moe.experts.{e}.w2"},
}
# llama.cpp's converter stores Gemma's norm weights w as 1 + w (its kernels multiply by the weight alone);
# transformers subtracts the 1 again when it reads them, and so does kvyard, so both round alike.
_NORM_SHIFT = {"gemma3": 1.0}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")

# HF config key <- `{arch}.<suffix>` metadata key.
_ARCH_KEYS = {
    "num_hidden_layers": "block_count",
    "hidden_size": "embedding_length",
    "intermediate_size": "feed_forward_length",
    "num_attention_heads": "attention.head_count",
    "num_key_value_heads": "attention.head_count_kv",
    "rms_norm_eps": "attention.layer_norm_rms_epsilon",
    "rope_theta": "rope.freq_base",
    "max_position_embeddings": "context_length",
    "head_dim": "attention.key_length",
    "vocab_size": "vocab_size",
    "sliding_window": "attention.sliding_window",
    "num_experts": "expert_count",
    "num_experts_per_tok": "expert_used_count",
    "moe_intermediate_size": "expert_feed_forward_length",
    "shared_expert_intermediate_size": "expert_shared_feed_forward_length",
}
_REQUIRED_ARCH_KEYS = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count")


def hf_tensor_name(gguf_name: str, model_type: str = "llama") -> str | None:
    """The HF parameter name for a GGUF tensor name, or None for tensors the model does not use. A stack of
    experts gets one name with `{e}` where the expert's index goes."""
    stem, _, kind = gguf_name.rpartition(".")
    if stem in _GLOBAL_TENSORS and kind == "weight":
        return f"{_GLOBAL_TENSORS[stem]}.weight"
    m = _LAYER_RE.fullmatch(gguf_name)
    layer_tensors = _LAYER_TENSORS_BY_TYPE.get(model_type, _LAYER_TENSORS)
    if m and m.group(2) in layer_tensors:
        return f"model.layers.{m.group(1)}.{layer_tensors[m.group(2)]}.{m.group(3)}"
    return None


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's `permute`: per head, rows (pair, 2) back to (2 halves, pair)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_metadata(reader_or_path: GGUFReader | str | Path) -> dict[str, Any]:
    """Scalar and string metadata, plus short arrays. The tokenizer's big arrays (tokens, merges,
    token types) are left out: they cost seconds to turn into Python objects and transformers reads
    them itself."""
    reader = reader_or_path if isinstance(reader_or_path, GGUFReader) else open_reader(Path(reader_or_path))
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if field.types and field.types[0] == GGUFValueType.ARRAY and len(field.data) > 256:
            continue
        value = field.contents()
        if field.types == [GGUFValueType.FLOAT32]:
            # The converter stored a float32; its shortest decimal is what the config said (1e-05, not
            # 9.999999747378752e-06).
            value = float(str(np.float32(value)))
        out[key] = value
    return out


def open_reader(path: Path) -> GGUFReader:
    try:
        return GGUFReader(path)
    except (ValueError, OSError, KeyError, IndexError) as e:
        raise CheckpointError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from e


def _rope_scaling(meta: dict[str, Any], arch: str) -> dict[str, Any] | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if kind is None and meta.get(f"{arch}.rope.scale_linear") not in (None, 1.0):
        kind, factor = "linear", meta[f"{arch}.rope.scale_linear"]  # the pre-2024 spelling
    if kind in (None, "none"):
        return None
    out: dict[str, Any] = {"rope_type": kind, "factor": float(factor if factor is not None else 1.0)}
    extras = {
        "original_context_length": ("original_max_position_embeddings", int),
        "attn_factor": ("attention_factor", float),
        "yarn_beta_fast": ("beta_fast", float),
        "yarn_beta_slow": ("beta_slow", float),
    }
    for suffix, (hf_key, cast) in extras.items():
        if (v := meta.get(f"{arch}.rope.scaling.{suffix}")) is not None:
            out[hf_key] = cast(v)
    return out


def hf_config_from_gguf(reader: GGUFReader, path: Path) -> dict[str, Any]:
    """An HF-style config.json dict built from GGUF metadata and the tensor table."""
    meta = gguf_metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"{path}: GGUF architecture {arch!r} is not supported; kvyard reads {sorted(GGUF_ARCHITECTURES)}"
        )
    missing = [f"{arch}.{k}" for k in _REQUIRED_ARCH_KEYS if f"{arch}.{k}" not in meta]
    if missing:
        raise CheckpointError(f"{path}: {arch} GGUF metadata is missing {missing}")
    if int(meta.get("split.count", 1)) > 1:
        raise CheckpointError(
            f"{path}: one part of a split GGUF ({meta['split.count']} parts); merge them first "
            "(llama-gguf-split --merge) and pass the merged file"
        )
    model_type, hf_arch = GGUF_ARCHITECTURES[arch]
    names = {t.name for t in reader.tensors}
    cfg: dict[str, Any] = {"model_type": model_type, "architectures": [hf_arch]}
    for hf_key, suffix in _ARCH_KEYS.items():
        if (v := meta.get(f"{arch}.{suffix}")) is not None:
            cfg[hf_key] = v
    if cfg.get("num_experts"):
        _moe_config(cfg, meta, arch, names)
    if "vocab_size" not in cfg:
        cfg["vocab_size"] = _vocab_size(reader, path)
    cfg["tie_word_embeddings"] = "output.weight" not in names
    cfg["attention_bias"] = "blk.0.attn_q.bias" in names
    cfg["rope_scaling"] = _rope_scaling(meta, arch)
    if arch == "gemma3":
        # Not in the file: llama.cpp scales queries by head_dim (but for the 27B), as HF's default of 256 does.
        cfg["query_pre_attn_scalar"] = cfg.get("head_dim", 256)
    cfg["bos_token_id"] = meta.get("tokenizer.ggml.bos_token_id")
    # llama.cpp stops on EOS and on EOT (chat end-of-turn); the engine should stop on both.
    eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta]
    eos = list(dict.fromkeys(eos))
    cfg["eos_token_id"] = eos[0] if len(eos) == 1 else (eos or None)
    if "tokenizer.ggml.padding_token_id" in meta:
        cfg["pad_token_id"] = meta["tokenizer.ggml.padding_token_id"]
    return cfg


def _moe_config(cfg: dict[str, Any], meta: dict[str, Any], arch: str, names: set[str]) -> None:
    """The MoE settings HF configs carry, from the expert metadata and which layers have a router."""
    if arch == "llama":  # Mixtral is llama with experts
        cfg.update(model_type="mixtral", architectures=["MixtralForCausalLM"], num_local_experts=cfg["num_experts"])
        cfg["intermediate_size"] = cfg.pop("moe_intermediate_size", cfg["intermediate_size"])
    cfg["norm_topk_prob"] = bool(meta.get(f"{arch}.expert_weights_norm", _NORM_TOPK.get(arch, False)))
    cfg["mlp_only_layers"] = [i for i in range(int(cfg["num_hidden_layers"]))
                              if f"blk.{i}.ffn_gate_inp.weight" not in names]


def _vocab_size(reader: GGUFReader, path: Path) -> int:
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None:
        return len(tokens.data)
    for t in reader.tensors:
        if t.name == "token_embd.weight":
            return int(t.shape[-1])  # GGUF shape lists the embedding width first
    raise CheckpointError(f"{path}: cannot tell the vocabulary size (no vocab_size, tokens or token_embd)")


@cache
def can_dequantize(qtype: GGMLQuantizationType) -> bool:
    """Whether gguf-py can dequantize this type: try it on one block of zeros."""
    _, type_size = GGML_QUANT_SIZES[qtype]
    try:
        dequantize(np.zeros((1, type_size), dtype=np.uint8), qtype)
    except (NotImplementedError, ValueError):
        return False
    return True


def _type_name(qtype: Any) -> str:
    return getattr(qtype, "name", str(qtype))


def _check_types(tensors: list[ReaderTensor], path: Path, arch: str) -> None:
    for t in tensors:
        if t.tensor_type not in GGML_QUANT_SIZES or not can_dequantize(t.tensor_type):
            raise CheckpointError(
                f"{path}: {arch} tensor {t.name} has type {_type_name(t.tensor_type)}, which kvyard cannot dequantize"
            )


def read_tensor(t: ReaderTensor, permute_heads: int | None = None) -> torch.Tensor:
    """One tensor, dequantized to float32 in HF layout (and un-permuted when `permute_heads` is set)."""
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    arr = dequantize(t.data, t.tensor_type).reshape(shape)
    if permute_heads is not None:
        arr = unpermute_qk(arr, permute_heads)
    # F32 tensors come back as read-only views of the memmap; torch wants memory it may write.
    arr = np.ascontiguousarray(arr, dtype=np.float32)
    if not arr.flags.writeable:
        arr = arr.copy()
    return torch.from_numpy(arr)


def _permute_heads(arch: str, hf_name: str, config: ModelConfig) -> int | None:
    if arch not in _PERMUTED_QK:
        return None
    if ".self_attn.q_proj." in hf_name:
        return config.num_heads
    if ".self_attn.k_proj." in hf_name:
        return config.num_kv_heads
    return None


def _stream(
    plan: list[tuple[str, ReaderTensor, int | None]], path: Path, native: frozenset[str] = frozenset(),
    norm_shift: float = 0.0,
) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """Each tensor dequantized, except those named in `native`, which keep their blocks (gguf_native.py);
    `norm_shift` is taken off every norm weight (_NORM_SHIFT)."""
    for hf_name, t, heads in plan:
        try:
            if hf_name in native:
                tensor = read_native(t, None if heads is None else functools.partial(unpermute_qk, n_head=heads))
            else:
                tensor = read_tensor(t, heads)
                if norm_shift and hf_name.endswith("norm.weight"):
                    tensor = tensor - norm_shift
        except (ValueError, NotImplementedError, OSError) as e:
            raise CheckpointError(f"{path}: cannot read tensor {t.name} ({type(e).__name__}: {e})") from e
        if "{e}" in hf_name:  # a stack of experts: one HF tensor each
            for e in range(tensor.shape[0]):
                yield hf_name.format(e=e), tensor[e]
        elif hf_name.endswith("shared_expert_gate.weight") and tensor.dim() == 1:
            yield hf_name, tensor.unsqueeze(0)  # llama.cpp keeps it as a vector, HF as a [1, hidden] linear
        else:
            yield hf_name, tensor


def load_gguf_tokenizer(path: Path, reader: GGUFReader) -> Any:
    """transformers' conversion of the GGUF vocabulary, cached as tokenizer.json after the first time.

    The conversion parses the whole vocabulary again (seconds for 150k tokens); the cache is keyed by the
    file's path, size and mtime, so a changed file is converted anew.
    """
    # Imported here: transformers is slow to import and only the tokenizer needs it.
    from transformers import AutoTokenizer

    from kvyard.loader.registry import cache_dir

    st = path.resolve().stat()
    key = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = cache_dir() / ".tokenizers" / f"{path.stem}-{key}"
    if (cached / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(str(cached))
    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:  # transformers raises many types; all mean "this tokenizer is unusable"
        raise CheckpointError(f"{path}: cannot build a tokenizer from the GGUF metadata ({e})") from e
    field = reader.fields.get("tokenizer.chat_template")
    if not getattr(tok, "chat_template", None) and field is not None:
        tok.chat_template = field.contents()  # older transformers dropped it; keep the file's template
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=cached.parent))
        tok.save_pretrained(str(tmp))
        os.replace(tmp, cached)  # atomic: a concurrent loader sees all of it or nothing
    except OSError:
        pass  # a read-only or raced cache only costs the conversion next time
    return tok


def load_gguf(path: str | Path) -> Checkpoint:
    """Open a GGUF file; tensors are dequantized one at a time when the stream is consumed."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such GGUF file")
    reader = open_reader(path)
    hf_config = hf_config_from_gguf(reader, path)
    arch = reader.fields["general.architecture"].contents()
    config = ModelConfig.from_hf(hf_config, source=str(path))
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        # Llama 3.1-style rope scaling lives in this tensor, not in metadata; ignoring it would be wrong.
        raise UnsupportedArchitectureError(
            f"{path}: {arch} with rope_freqs (llama3 rope scaling) is not supported"
        )
    wanted = set(expected_tensor_names(config))
    plan = []
    for t in reader.tensors:
        hf_name = hf_tensor_name(t.name, config.model_type)
        if hf_name in wanted or (hf_name is not None and hf_name.format(e=0) in wanted):
            plan.append((hf_name, t, _permute_heads(arch, hf_name, config)))
    present = (n.format(e=e) for n, _, _ in plan for e in range(config.num_experts or 1))
    check_tensor_names(present, config, str(path), f"{arch} (GGUF)")
    _check_types([t for _, t, _ in plan], path, arch)
    tokenizer = load_gguf_tokenizer(path, reader)
    types = {name: t.tensor_type for name, t, _ in plan}
    embed = next(t for name, t, _ in plan if name == "model.embed_tokens.weight")
    if config.tie_word_embeddings:  # the head is the table: kept in its blocks it becomes a weight of its own
        types["lm_head.weight"] = embed.tensor_type
    native = native_layers(config, types)
    tied_head = config.tie_word_embeddings and "lm_head.weight" in native  # (the lookup table stays dense)
    native_plan = [*plan, ("lm_head.weight", embed, None)] if tied_head else plan
    return Checkpoint(
        path=path,
        hf_config=hf_config,
        config=config,
        tokenizer=tokenizer,
        # each ReaderTensor's data is a view of the memmap
        tensors=lambda: _stream(plan, path, norm_shift=_NORM_SHIFT.get(arch, 0.0)),
        native_tensors=lambda: _stream(native_plan, path, native, _NORM_SHIFT.get(arch, 0.0)),
        native_layers=len(native),
        generation_defaults=from_gguf_metadata(gguf_metadata(reader), str(path)),
    )


def native_layers(config: ModelConfig, types: dict[str, GGMLQuantizationType]) -> frozenset[str]:
    """The weights that `--quantization gguf` keeps in their blocks: every member of a linear unit whose members'
    types all have one kvyard form (q|k|v and gate|up are fused, so Q5_0 beside Q8_0 is kept, Q4_1 beside Q8_0
    is not). The head too: it is not rounded here, so there is nothing to protect it from. A unit with any
    other type (Q4_K_M files put Q6_K in some) stays dense."""
    names = set()
    for unit in linear_units(config):
        weights = [m + ".weight" for m in unit.members]
        schemes = {SCHEMES.get(types[w]) if w in types else None for w in weights}
        if len(schemes) == 1 and None not in schemes:
            names.update(weights)
    return frozenset(names)
