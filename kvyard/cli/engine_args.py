"""Command-line flags for every EngineConfig field, derived from the dataclass so they never drift."""

import argparse
import dataclasses
import typing
from typing import Any

from kvyard.config import EngineConfig

_HELP = {
    "model": "model name (smollm2-135m, qwen2.5-coder-0.5b, ...), HF directory or .gguf file",
    "dtype": "bfloat16 or float32 (float16 on CUDA)",
    "device": "cpu or cuda",
    "kv_cache_memory": "KV cache budget: bytes, or with a unit such as 512MiB, 2GiB",
    "kv_offload_host_memory": "host memory for KV blocks evicted from the prefix cache (an offload tier), e.g. 4GiB; 0 = off",
    "kv_offload_host_segment": "auto (the host KV tier in /dev/shm, found again by a restarted worker, where there is "
                               "room and no other worker holds it), a file path, or off (private memory)",
    "kv_offload_disk": "a directory for KV blocks on local disk (an offload tier kept across restarts)",
    "kv_offload_disk_capacity": "the most bytes the disk KV tier keeps, e.g. 8GiB",
    "kv_offload_redis": "redis://HOST:PORT/DB (or unix:///PATH.sock) of a KV offload tier shared by replicas (its budget: the server's maxmemory)",
    "kv_offload_decision": "auto (read a tier only where measured faster than recomputing), load or recompute",
    "kv_offload_write": "when blocks go to the offload tiers: back (when the pool evicts them) or through (when cached)",
    "kv_offload_tiers": "inclusive (every block to every tier; the disk must be larger than the host tier) or "
                        "exclusive (to the disk only when the host tier evicts it: the capacities add up)",
    "kv_offload_load": "blocking (the engine reads a request's blocks from the disk or Redis, then steps on) or overlap "
                       "(reader threads while the engine steps the others: smoother streams)",
    "kv_offload_admit_after": "write a block to the tiers only once this many prompts carried it (1: every block)",
    "block_size": "tokens per KV block",
    "max_num_batched_tokens": "token budget of one forward pass (decodes + prefill chunks)",
    "max_num_seqs": "most requests running at once",
    "enable_chunked_prefill": "split long prompts across steps",
    "batch_invariant": "bf16 outputs that depend only on each request's own tokens, never on the batch, the chunking, "
                       "the prefix cache or speculation (default: on where it costs nothing, on AVX512-BF16 CPUs "
                       "without AMX for dense bf16 models; elsewhere slower: see README)",
    "dynamic_quant": "low-bit weights' batched matmuls with activations rounded to int8 per 32 values, in integer "
                     "dot products (AVX2 or AVX-512 VNNI; faster, not exact; see README)",
    "max_itl_ms": "inter-token target while requests decode: a step takes only the prompt tokens that fit it "
                  "(default: twice a full batch of decodes, by the measured step cost; 0: off)",
    "hold_bursts": "a burst of prompts keeps the full token budget until all of it is prefilled, as vLLM does: lower "
                   "TTFT tails, streams stall during bursts (default: until streams outnumber its remaining prompts)",
    "enable_prefix_caching": "reuse the KV cache of prompt prefixes seen before",
    "max_model_len": "context limit (default: the model's)",
    "tensor_parallel_size": "ranks that each hold a share of every layer (heads, KV heads, MLP columns)",
    "pipeline_parallel_size": "stages, one process each, that each hold a contiguous share of the layers",
    "enable_expert_parallel": "the tensor-parallel ranks hold whole experts, a share each (Mixture-of-Experts models), "
                              "instead of a slice of every expert",
    "expert_placement": "which experts a rank holds: contiguous (runs of experts) or round_robin (expert e on rank e %% ranks)",
    "pipeline_overlap": "keep a batch a stage in flight, so the stages work at once (--no-pipeline-overlap: one batch at a time)",
    "bind_threads": "bind each process of a parallel replica (every rank of every stage) to its own share of the cores",
    "tensor_parallel_comm": "how the ranks exchange partial sums: shm (shared memory, one host) or gloo (TCP)",
    "num_threads": "CPU threads for torch (default: all cores)",
    "kv_cache_dtype": "KV cache storage: auto (the model dtype) or int8",
    "quantization": "quantize weights on load: int8 or int4-g32|g64|g128[-asym|-min] (lm_head stays dense), "
                    "or gguf: keep a GGUF file's Q4_0/Q4_1/Q4_K/Q5_0/Q5_1/Q8_0 layers in their own blocks",
    "speculative_method": "speculative decoding: ngram, draft (--speculative-model) or speculator (--speculator)",
    "speculative_model": "draft model for speculative decoding (same tokenizer as --model); implies draft",
    "speculator": "trained speculator directory (kvyard speculator train) for --model; implies speculator",
    "num_speculative_tokens": "most draft tokens verified per request and step",
    "speculative_adaptive": "adapt the draft length per request to its acceptance rate",
    "speculative_max_batch": "speculate only in steps where at most this many requests decode",
    "lora_memory": "bytes the loaded LoRA adapters may take, e.g. 512MiB; past it the least recently used idle one "
                   "is unloaded and read again when named (0: no limit)",
    "ngram_min": "prompt lookup: shortest tail n-gram to match",
    "ngram_max": "prompt lookup: longest tail n-gram to match",
}

# Mapping fields, given as a repeatable NAME=VALUE flag
_MAPPING_FLAGS = {"lora_adapters": ("--lora", "NAME=PATH", "serve the PEFT LoRA adapter at PATH as model NAME "
                                                          "(repeatable)")}


class _NameValue(argparse.Action):
    """NAME=VALUE into a dict (a fresh one per parse: the default is never mutated)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, value: Any,
                 option: str | None = None) -> None:
        name, sep, rest = str(value).partition("=")
        if not sep or not name or not rest:
            parser.error(f"{option} takes NAME=VALUE, got {value!r}")
        setattr(namespace, self.dest, {**(getattr(namespace, self.dest) or {}), name: rest})


def _flag_type(hint: Any) -> type:
    """int or float for a field that holds only that (or None), str for the rest: `kv_cache_memory` (int | str)
    parses sizes such as 2GiB itself, `dtype` names a torch dtype."""
    kinds = [k for k in typing.get_args(hint) or (hint,) if k is not type(None)]
    return kinds[0] if kinds in ([int], [float]) else str


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        if f.name in _MAPPING_FLAGS:
            flag, metavar, help_text = _MAPPING_FLAGS[f.name]
            g.add_argument(flag, dest=f.name, action=_NameValue, default=default, metavar=metavar, help=help_text)
        elif isinstance(default, bool) or set(typing.get_args(hints[f.name])) == {bool, type(None)}:
            g.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=_HELP.get(f.name))
        else:
            g.add_argument(flag, type=_flag_type(hints[f.name]), default=default, help=_HELP.get(f.name))


def engine_config_from_args(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)}
    values.update(overrides)
    return EngineConfig(**values)
