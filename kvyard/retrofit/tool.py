"""`kvyard retrofit`: convert a model's attention to a cheaper kind, distil it back toward the original, write it
as a checkpoint kvyard serves, and report what it costs against the original: KV bytes per token, and the
next-token KL and top-1 agreement on held-out text in the original's own distribution (its greedy continuations
of kvyard's held-out chat prompts), after the conversion and after the distillation. With a distillation, the
undistilled conversion is kept in OUT/converted for comparisons (`kvyard bench spec --target OUT/converted`).
KV bytes are counted per token of a `kv_context`-token sequence, where a sliding layer holds only its window."""

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvyard.errors import ConfigError
from kvyard.retrofit.distill import DistillSettings, distill_back
from kvyard.retrofit.sinks import SinkMasks


@dataclass
class RetrofitSettings:
    model: str  # a name, HF directory or .gguf file
    out: str  # the converted checkpoint's directory
    attention: str = "mqa"  # mqa: fewer KV heads; swa: sliding-window attention on chosen layers
    kv_heads: int = 1  # mqa: the KV heads left
    window: int = 128  # swa: the window, in positions
    sinks: int = 0  # swa: the first positions the sliding layers also see (attention sinks)
    layers: str = "all"  # swa: the layers that slide (all, or indices and ranges: 2-27,29)
    kv_context: int = 2048  # KV bytes are counted for a sequence this long (a sliding layer keeps its window)
    eval_prompts: int = 16  # held-out prompts whose continuations measure the divergence
    kv_dtype: str = "auto"  # for the KV bytes per token (the engine's kv_cache_dtype)
    dtype: str = "bfloat16"  # the serving dtype (KV bytes are counted in it; the original's answers come in it)
    distill_prompts: int = 256  # chat prompts the original answers for the distillation (0: no distillation)
    distill_tokens: int = 96  # the original's answer length
    distill: DistillSettings = field(default_factory=DistillSettings)

    def __post_init__(self) -> None:
        if self.attention not in ("mqa", "swa"):
            raise ConfigError(f"--attention {self.attention!r}: mqa or swa", param="attention")


def retrofit(s: RetrofitSettings) -> dict[str, Any]:
    import transformers

    from kvyard.loader.checkpoint import load_checkpoint
    from kvyard.loader.hf_model import hf_causal_lm
    from kvyard.loader.registry import resolve_model
    from kvyard.models.derived import divergence, original_texts, save_checkpoint

    started = time.perf_counter()
    ckpt = load_checkpoint(resolve_model(s.model))
    weights = {name: t.float() for name, t in ckpt.tensors()}
    original = hf_causal_lm(ckpt.hf_config, weights)
    config, converted_weights = _convert(ckpt.hf_config, weights, s)
    out = Path(s.out).expanduser()
    save_checkpoint(out, config, converted_weights, ckpt.tokenizer)
    converted = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    if config.get("sliding_window_sinks"):  # HF knows no sinks: its masks are made for it
        converted = SinkMasks(converted, s.window, s.sinks).eval()
    held_out = original_texts(ckpt.tokenizer, original, s.eval_prompts, offset=-s.eval_prompts)
    before, after = _kv_bytes(ckpt.hf_config, s), _kv_bytes(config, s)
    report = {"settings": asdict(s), "source": str(ckpt.path),
              "kv_heads": [int(ckpt.hf_config.get("num_key_value_heads") or 0), int(config["num_key_value_heads"])],
              "kv_bytes_per_token": [before, after], "kv_context": s.kv_context, "kv_saving": before / after,
              "converted": divergence(original, converted, held_out)}
    if s.distill_prompts:
        save_checkpoint(out / "converted", config, converted_weights, ckpt.tokenizer)  # kept, to compare with
        samples = _original_answers(ckpt.path, s)
        report["distillation"] = {"samples": len(samples), **distill_back(converted, samples, s.distill)}
        report["distilled"] = divergence(original, converted, held_out)
        converted.save_pretrained(str(out))  # the distilled weights replace the converted ones
    report["seconds"] = round(time.perf_counter() - started, 1)
    (out / "retrofit_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def _original_answers(path: Path, s: RetrofitSettings) -> list[Any]:
    """The original model's greedy answers to kvyard's chat prompts, with its top-20 logprobs (kvyard's engine)."""
    from kvyard.llm import LLM
    from kvyard.models.derived import SPEC_DATA
    from kvyard.spec.speculator.distill import distill
    from kvyard.spec.speculator.prompts import read_prompts

    llm = LLM(str(path), dtype=s.dtype)
    prompts = read_prompts(SPEC_DATA / "chat_train.jsonl", llm.tokenizer, s.distill_prompts)
    samples = distill(llm, prompts, s.distill_tokens, use_tqdm=s.distill.progress)
    llm.close()
    return samples


def _convert(hf_config: dict[str, Any], weights: dict[str, torch.Tensor], s: RetrofitSettings
             ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    from kvyard.retrofit.attention import parse_layers, pool_kv_heads, slide_layers

    if s.attention == "mqa":
        return pool_kv_heads(hf_config, weights, s.kv_heads)
    layers = parse_layers(s.layers, int(hf_config["num_hidden_layers"]))
    return slide_layers(hf_config, weights, s.window, layers, s.sinks)


def _kv_bytes(hf_config: dict[str, Any], s: RetrofitSettings) -> float:
    """KV bytes per token of a `kv_context`-token sequence: a sliding layer holds only its window's and its sinks'."""
    from kvyard.models.config import ModelConfig
    from kvyard.plan.memory import kv_bytes_per_token

    cfg = ModelConfig.from_hf(hf_config)
    per_layer = kv_bytes_per_token(cfg, s.kv_dtype, getattr(torch, s.dtype)) / cfg.num_layers
    windows = cfg.layer_windows or (None,) * cfg.num_layers
    sinks = cfg.sliding_window_sinks
    held = sum(min(s.kv_context, w + sinks) if w is not None else s.kv_context for w in windows)
    return per_layer * held / s.kv_context
