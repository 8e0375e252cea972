"""Engine settings, with one parser for human-written sizes such as `2GiB`, and the check every settings
mapping from a file goes through (`check_fields`)."""

import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from kvyard.errors import ConfigError, InvalidRequestError
from kvyard.parallel.expert import PLACEMENTS

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def parse_bytes(value: str | int | float) -> int:
    if isinstance(value, int | float):
        return int(value)
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", value)
    if not m or m.group(2).lower() not in _UNITS:
        raise InvalidRequestError(f"cannot read a size from {value!r} (try 1073741824, 512MiB or 2GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise InvalidRequestError(f"unknown dtype {name!r}; choose from {sorted(DTYPES)}", param="dtype")
    return DTYPES[name]


KV_CACHE_DTYPES = ("auto", "int8")  # auto: the model's dtype

# Default token budgets. Offline, only throughput counts: on CPU a 2,048-token step prefilled 32 prompts of
# 128 tokens in 0.83 s against 1.25 s in 512-token steps (bigger GEMMs, fewer per-step costs). A server has
# streams to keep moving: with stall-free batching on (the default), the inter-token target, not the budget,
# bounds a step that decodes, so the budget only caps steps nobody waits on and takes vLLM-CPU's 2,048; with
# it off, the budget is all that bounds a stream's wait, and stays at 512.
OFFLINE_TOKEN_BUDGET = 2048
ONLINE_TOKEN_BUDGET = 2048
ONLINE_TOKEN_BUDGET_NO_ITL_TARGET = 512


@dataclass
class EngineConfig:
    model: str = "smollm2-135m"
    dtype: str | torch.dtype = "bfloat16"
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    kv_cache_memory: int | str = "1GiB"
    block_size: int = 16
    # Tokens per forward pass, shared by decodes and prefill chunks (vLLM v1's token budget). None: by use,
    # as vLLM chooses it: OFFLINE_TOKEN_BUDGET for the LLM class, ONLINE_TOKEN_BUDGET for everything else.
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 64
    enable_chunked_prefill: bool = True
    # Stall-free batching: while requests decode, a step takes only the prompt tokens that keep its predicted
    # time within this many milliseconds (kvyard/engine/step_cost.py). None: set from the measured cost of a
    # full batch of decodes (servers) or off (the LLM class); 0: off, prompt chunks fill the token budget.
    max_itl_ms: float | None = None
    # Under the automatic target, a burst of prompts (as many as the streams decoding) is taken at the full token
    # budget. True: until every prompt in it is prefilled, as vLLM's chunked prefill does (lower TTFT tails; the
    # burst's first streams stall for its later steps). False: only while its prompts still outnumber the streams,
    # its first prompts' included (streams stall less; a big burst's last prompts wait longer).
    hold_bursts: bool = False
    enable_prefix_caching: bool = True  # reuse KV of prompt prefixes seen before
    # KV offload (kvyard/offload/): bytes of host memory for prefix-cache blocks the pool evicts; 0 = off
    kv_offload_host_memory: int | str = 0
    # Where the host tier's pool lives: auto, a shared-memory file ($KVYARD_SHM_DIR or /dev/shm, named by the
    # model and KV layout) that a restarted worker finds again, where there is room and no other worker holds it;
    # a file path; or off (private memory)
    kv_offload_host_segment: str = "auto"
    kv_offload_disk: str | None = None  # a directory for KV blocks on local disk, kept across restarts
    kv_offload_disk_capacity: int | str = "8GiB"
    kv_offload_redis: str | None = None  # redis://host:port/db or unix:///path.sock of a KV tier the replicas share
    # auto: read a tier's blocks back only where that is measured to beat recomputing them; load: always; recompute:
    # never (the tiers are still written)
    kv_offload_decision: str = "auto"
    kv_offload_write: str = "back"  # back: blocks go to the tiers when the pool evicts them; through: when cached
    # inclusive: every block to every tier (a disk smaller than the host tier is refused); exclusive: to the disk
    # only when the host tier evicts it, so the two capacities add up
    kv_offload_tiers: str = "inclusive"
    kv_offload_admit_after: int = 1  # write a block only once this many prompts carried it (1: every block)
    # blocking: the engine reads a request's blocks from the disk or Redis before it steps again; overlap: on
    # reader threads while it steps the other requests (smooth streams, but with a pool far smaller than the
    # working set a waiting request loses its place and its blocks, BENCHMARKS.md)
    kv_offload_load: str = "blocking"
    max_model_len: int | None = None  # default: the model's context window
    num_threads: int | None = None  # CPU threads for torch; default: all cores
    # Tensor parallelism (kvyard/parallel/): this engine is one rank's share of the weights and KV cache, in the
    # process's group of this many ranks (kvyard.parallel.comm.join_group), each rank stepping the same batches
    tensor_parallel_size: int = 1
    # Pipeline parallelism (kvyard/parallel/pipeline.py): the layers split into this many stages, one process each
    pipeline_parallel_size: int = 1
    # Expert parallelism (kvyard/parallel/expert.py): the tensor-parallel ranks hold whole experts, a share each,
    # placed contiguous (runs of experts) or round_robin (expert e on rank e % ranks), instead of every expert sliced
    enable_expert_parallel: bool = False
    expert_placement: str = "contiguous"
    pipeline_overlap: bool = True  # a batch a stage in flight, so the stages work at once (off: one at a time)
    # How the ranks an engine starts itself exchange partial sums: shm (a shared-memory segment, one host) or gloo
    tensor_parallel_comm: str = "shm"
    # Bind each process of a parallel replica to its own share of the cores (kvyard/parallel/affinity.py)
    bind_threads: bool = True
    # Quantize linear weights while loading (int8, int4-g128, ...), or `gguf`: keep a GGUF file's
    # Q4_0/Q4_1/Q4_K/Q5_0/Q5_1/Q8_0 layers in their own blocks. A `kvyard quantize` directory needs no flag,
    # its plan is in config.json.
    quantization: str | None = None
    kv_cache_dtype: str = "auto"  # auto (the model dtype) or int8 (a scale per token and head)
    # Speculative decoding (kvyard/spec/): None, "ngram" (prompt lookup), "draft" (speculative_model) or
    # "speculator" (a `kvyard speculator train` directory).
    speculative_method: str | None = None
    speculative_model: str | None = None  # the draft model: a name, HF directory or .gguf file
    speculator: str | None = None  # a trained speculator directory, for this model only
    num_speculative_tokens: int = 4  # the most drafts per request and step (k_max)
    speculative_adaptive: bool = True  # adapt k per request to its acceptance
    speculative_max_batch: int = 8  # no speculation in a step where more requests decode than this
    # LoRA adapters served beside the base model (kvyard/lora/): name -> a PEFT adapter directory; a request names
    # one as its model
    lora_adapters: dict[str, str] = field(default_factory=dict)
    # Bytes the loaded adapters' weights may take; past it the least recently used one no request runs with is
    # unloaded, and read again from its directory when a request names it. 0: no limit
    lora_memory: int | str = 0
    # Batch-invariant bf16 (kvyard/models/linear.py RowInvariantWeight, attention.py invariant_rows): a token's
    # result depends only on its own context, not on the batch, the chunking, the prefix cache or speculation.
    # Dense bf16 weights and the portable low-bit kernel's on CPU, one process; _check_batch_invariant refuses the rest.
    # None (the default): on where the default path already is invariant at no cost (models/invariance.py), else off.
    batch_invariant: bool | None = None
    # Low-bit weights' several-row matmuls (decode batches, prefill chunks) with the activations rounded to int8
    # per run of 32 values, in integer dot products (csrc/lowbit_int8_act.cpp, AVX2 or AVX-512 VNNI): a numerics
    # change, so off unless asked for; its KL against the fp32 model is in BENCHMARKS.md. One row keeps its
    # exact-as-bf16 kernel.
    dynamic_quant: bool = False
    ngram_min: int = 1  # prompt lookup matches the last n tokens, n from ngram_max down to ngram_min
    ngram_max: int = 4

    def __post_init__(self) -> None:
        self.dtype = parse_dtype(self.dtype)
        self.kv_cache_memory = parse_bytes(self.kv_cache_memory)
        self.lora_memory = parse_bytes(self.lora_memory)
        self.kv_offload_host_memory = parse_bytes(self.kv_offload_host_memory)
        self.kv_offload_disk_capacity = parse_bytes(self.kv_offload_disk_capacity)
        if self.kv_offload_decision not in ("auto", "load", "recompute"):
            raise InvalidRequestError(f"kv_offload_decision must be auto, load or recompute, got "
                                      f"{self.kv_offload_decision!r}", param="kv_offload_decision")
        if self.kv_offload_tiers not in ("inclusive", "exclusive"):
            raise InvalidRequestError(f"kv_offload_tiers must be inclusive or exclusive, got "
                                      f"{self.kv_offload_tiers!r}", param="kv_offload_tiers")
        if self.kv_offload_admit_after < 1:
            raise InvalidRequestError(f"kv_offload_admit_after must be at least 1, got {self.kv_offload_admit_after}",
                                      param="kv_offload_admit_after")
        if self.kv_offload_load not in ("overlap", "blocking"):
            raise InvalidRequestError(f"kv_offload_load must be overlap or blocking, got {self.kv_offload_load!r}",
                                      param="kv_offload_load")
        if self.kv_offload_write not in ("back", "through"):
            raise InvalidRequestError(f"kv_offload_write must be back or through, got {self.kv_offload_write!r}",
                                      param="kv_offload_write")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidRequestError(f"kv_cache_dtype must be auto or int8, got {self.kv_cache_dtype!r}",
                                      param="kv_cache_dtype")
        if self.quantization:
            from kvyard.quant.scheme import KEEP_GGUF, parse_weight_scheme

            if self.quantization != KEEP_GGUF:
                parse_weight_scheme(self.quantization)
        if self.expert_placement not in PLACEMENTS:
            raise InvalidRequestError(f"expert_placement must be {' or '.join(PLACEMENTS)}, got "
                                      f"{self.expert_placement!r}", param="expert_placement")
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise InvalidRequestError(f"{name} must be >= 1", param=name)
        if self.max_itl_ms is not None and self.max_itl_ms < 0:
            raise InvalidRequestError("max_itl_ms must be >= 0 (0 turns the inter-token target off)",
                                      param="max_itl_ms")
        self._check_speculative()
        self._check_batch_invariant()
        self._check_dynamic_quant()

    def _check_batch_invariant(self) -> None:
        """The batch-invariant path covers what its kernels cover; anything else is refused rather than served
        with a promise it would not keep."""
        if self.batch_invariant:
            for what in self.batch_invariant_gaps():
                raise InvalidRequestError(f"batch_invariant does not cover {what}", param="batch_invariant")

    def batch_invariant_gaps(self) -> list[str]:
        """What in this configuration the batch-invariant path does not cover (empty: all of it)."""
        unsupported = [
            (self.dtype != torch.bfloat16, f"dtype {str(self.dtype).removeprefix('torch.')} (it covers bfloat16)"),
            (self.device != "cpu", f"device {self.device} (its kernels are kvyard's CPU kernels)"),
            (self.quantization not in (None, "gguf"), f"quantization {self.quantization} (of the low-bit weights it "
                                                        "covers a GGUF file's own blocks, --quantization gguf)"),
            (self.tensor_parallel_size > 1 or self.pipeline_parallel_size > 1, "tensor or pipeline parallelism"),
            (bool(self.lora_adapters), "LoRA adapters"),
            (self.kv_cache_dtype != "auto", "an int8 KV cache"),
            (self.dynamic_quant, "dynamic_quant (int8-rounded activations)"),
        ]
        return [what for refused, what in unsupported if refused]

    def _check_dynamic_quant(self) -> None:
        if not self.dynamic_quant:
            return
        unsupported = [
            (self.dtype != torch.bfloat16, f"dtype {str(self.dtype).removeprefix('torch.')} (it rounds bf16 "
                                           "activations; fp32 stays exact)"),
            (self.device != "cpu", f"device {self.device} (its kernel is kvyard's AVX2 CPU kernel)"),
        ]
        for refused, what in unsupported:
            if refused:
                raise InvalidRequestError(f"dynamic_quant does not cover {what}", param="dynamic_quant")

    @property
    def token_budget(self) -> int:
        """Tokens per forward pass: also the most rows any matmul of a step sees."""
        if self.max_num_batched_tokens:
            return self.max_num_batched_tokens
        return ONLINE_TOKEN_BUDGET if self.stall_free else ONLINE_TOKEN_BUDGET_NO_ITL_TARGET

    @property
    def stall_free(self) -> bool:
        """Whether prompt chunks are held to an inter-token target: chunking on, and the target not turned off."""
        return self.enable_chunked_prefill and self.max_itl_ms != 0

    def offline(self) -> "EngineConfig":
        """This config with the LLM class's defaults where none was chosen: the offline token budget, and no
        inter-token target, since no one watches the streams of a batch job."""
        return replace(self, max_num_batched_tokens=self.max_num_batched_tokens or OFFLINE_TOKEN_BUDGET,
                       max_itl_ms=0 if self.max_itl_ms is None else self.max_itl_ms)

    def _check_speculative(self) -> None:
        if self.speculative_model and self.speculative_method is None:
            self.speculative_method = "draft"  # a draft model alone says which method
        if self.speculator and self.speculative_method is None:
            self.speculative_method = "speculator"
        if self.speculative_method not in (None, "ngram", "draft", "speculator"):
            raise InvalidRequestError(
                f"speculative_method must be ngram, draft or speculator, got {self.speculative_method!r}",
                param="speculative_method")
        if self.speculative_method == "draft" and not self.speculative_model:
            raise InvalidRequestError("speculative_method draft needs speculative_model", param="speculative_model")
        if self.speculative_method == "speculator" and not self.speculator:
            raise InvalidRequestError("speculative_method speculator needs speculator (a directory)",
                                      param="speculator")
        for name in ("num_speculative_tokens", "speculative_max_batch", "ngram_min", "ngram_max"):
            if getattr(self, name) < 1:
                raise InvalidRequestError(f"{name} must be >= 1", param=name)


def check_fields(cls: type, values: dict[str, Any], where: str) -> dict[str, Any]:
    """Reject unknown names and values of the wrong basic type; the dataclass checks ranges itself."""
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    for key, value in values.items():
        if key not in known:
            raise ConfigError(f"{where}: unknown key {key!r}; known keys: {', '.join(sorted(known))}", param=key)
        if not _matches(value, hints[key]):
            raise ConfigError(f"{where}: {key} has the wrong type: {value!r}", param=key)
    return dict(values)


def section_setting(cls: type, value: Any, where: str, shorthand: str) -> Any:
    """A setting that is a dataclass of its own (a server's capture, a router's shadow): given as one, as a
    mapping of its fields (checked by `check_fields`), or as a string for its one required field `shorthand`;
    None: off."""
    if value is None or isinstance(value, cls):
        return value
    if isinstance(value, str):
        return cls(**{shorthand: value})
    return cls(**check_fields(cls, value, where))


def _matches(value: Any, hint: Any) -> bool:
    if hint is Any:
        return True
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_matches(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    return True  # a type YAML cannot spell (torch.dtype): leave it to the dataclass
