"""The engine: admits requests, runs scheduled steps on the model, and reports what each step produced."""

import itertools
import logging
import math
import os
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.profiler import record_function

from kvyard.cluster.ranks import current_placement, start_ray_ranks
from kvyard.config import EngineConfig
from kvyard.engine.block_manager import BlockManager
from kvyard.engine.calibrate import calibrate_step_cost
from kvyard.engine.host_memory import keep_freed_memory
from kvyard.engine.kv_cache import KVGroups, allocate_kv_caches, pool_sizes
from kvyard.engine.kv_events import KVEvent
from kvyard.engine.kv_handoff import HeldKV, select_blocks
from kvyard.engine.model_runner import ModelRunner, StepInput
from kvyard.engine.prompt_logprobs import record_prompt_logprobs
from kvyard.engine.repetition import RepetitionDetector
from kvyard.engine.request import Request
from kvyard.engine.sampler import sample
from kvyard.engine.scheduler import ScheduledBatch, Scheduler
from kvyard.engine.soft_tokens import SoftTokens, check_spans
from kvyard.engine.window_blocks import HybridBlocks, WindowBlocks
from kvyard.errors import AdapterBusyError, ConfigError, InvalidRequestError, PromptTooLongError
from kvyard.kernels import cpu as cpu_kernels
from kvyard.loader.checkpoint import Checkpoint, load_checkpoint
from kvyard.loader.registry import resolve_model
from kvyard.lora.adapter import LORA_FAMILIES, LoraAdapter, load_adapter
from kvyard.lora.stack import LoraRegistry
from kvyard.models.build import build_model
from kvyard.models.decoder import DecoderModel
from kvyard.models.invariance import invariant_by_default, model_gap
from kvyard.outputs import CompletionOutput, RequestOutput, TokenLogprob
from kvyard.parallel.affinity import bind_replica_process, cpus_for_children, replica_cpus
from kvyard.parallel.comm import current_group
from kvyard.parallel.pipeline import (
    PipelineDriver,
    PipelineStageDecoder,
    TensorParallelStage,
    check_pipeline_parallel,
    current_stage,
    pool_config,
    stage_config,
    start_stages,
)
from kvyard.parallel.ranks import DrivingRunner, Workers, start_workers
from kvyard.parallel.tensor import TensorParallelDecoder, check_tensor_parallel, local_config
from kvyard.quant.kv_smoothing import smooth_keys
from kvyard.quant.plan import served_tensors
from kvyard.quant.qtensor import QuantizedTensor
from kvyard.quant.scheme import KEEP_GGUF
from kvyard.sampling_params import SamplingParams
from kvyard.spec.decoding import split_logits
from kvyard.spec.setup import make_speculation
from kvyard.spec.verify import verify
from kvyard.structured.spec import StructuredOutput
from kvyard.tokenizer.detokenizer import Detokenizer

if TYPE_CHECKING:
    from kvyard.models.config import ModelConfig
    from kvyard.models.kv_layer import LayerKV
    from kvyard.offload.manager import KVOffload
    from kvyard.parallel.comm import GlooGroup
    from kvyard.structured.compiler import GrammarCompiler
    from kvyard.structured.matcher import GrammarState

log = logging.getLogger(__name__)

READ_WAIT_S = 0.005  # an idle step's longest wait for the offload tiers' reads (then it looks at new requests)


@dataclass
class _Tracked:
    req: Request
    detok: Detokenizer
    tokens_sent: int = 0
    repetition: RepetitionDetector | None = None


class LLMEngine:
    def __init__(self, cfg: EngineConfig):
        self._workers: Workers | None = None  # the other ranks, where this engine started them
        try:
            self._build(cfg)
        except BaseException:
            self.close()  # ranks it started must not wait for a rank 0 that never comes
            raise

    def _build(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        path = resolve_model(cfg.model)
        ckpt = load_checkpoint(path)
        self.model_path = path
        self.model_config = ckpt.config
        # The model's own sampling defaults (generation_config.json, GGUF metadata); the server applies them.
        self.generation_defaults = ckpt.generation_defaults
        self.tokenizer = ckpt.tokenizer
        self._fast_tokenizer = ckpt.tokenizer.backend_tokenizer
        device = torch.device(cfg.device)
        if device.type == "cpu":
            cpu_kernels.available()  # build (first run on a machine) or load them now, not in the first request
            keep_freed_memory()
        self._refuse_with_parallelism(ckpt.config)
        self._refuse_batch_invariant(ckpt.config)
        if self._leads_ranks():
            self._workers = self._start_ranks()
        group = self._parallel_group()
        stage, stages = current_stage() or (0, cfg.pipeline_parallel_size)
        # What this process holds: with tensor parallelism, its rank's share of the heads (and of the KV cache)
        experts = cfg.enable_expert_parallel
        local = ckpt.config if group is None else local_config(ckpt.config, group.size, experts)
        self.kv_groups = KVGroups.of(local)
        num_blocks, window_blocks = pool_sizes(pool_config(local, stages), self.kv_groups, cfg.block_size, cfg.dtype,
                                               cfg.kv_cache_memory, cfg.kv_cache_dtype, cfg.max_num_seqs,
                                               cfg.token_budget)
        context = min(ckpt.config.max_position_embeddings, cfg.max_model_len or 1 << 62)
        # A request must fit the whole pool, or preempting everyone else could still not make room.
        self.max_model_len = min(context, num_blocks * cfg.block_size)
        if self.kv_groups.window is not None and cfg.enable_chunked_prefill:
            # Every layer slides: a request holds only its window and the chunk it computes, however long.
            if (num_blocks - 2) * cfg.block_size >= self.kv_groups.window + cfg.token_budget:
                self.max_model_len = context
        sizes = dict(max_positions=self.max_model_len, max_rows=cfg.token_budget)
        placement = cfg.expert_placement if experts else None
        if stages > 1 and group is not None:
            model = TensorParallelStage(ckpt.config, group, stage, stages, cfg.dtype, device, **sizes,
                                        expert_placement=placement)
        elif stages > 1:
            model = PipelineStageDecoder(ckpt.config, stage, stages, cfg.dtype, device, **sizes)
        elif group is None:
            model = build_model(ckpt.config, cfg.dtype, device, **sizes)
        else:
            model = TensorParallelDecoder(ckpt.config, group, cfg.dtype, device, **sizes, expert_placement=placement)
        model.batch_invariant = bool(cfg.batch_invariant)  # before load: it decides the weights' resident form
        model.dynamic_quant = cfg.dynamic_quant
        model.load(self._weights(ckpt), str(path))
        self.batch_invariant = model.batch_invariant = self._batch_invariant(model)
        self._refuse_idle_dynamic_quant(model)
        self.lora = self._lora_adapters(model)
        if cfg.kv_cache_dtype == "int8":
            smooth_keys(model, self.tokenizer, max_len=min(256, self.max_model_len))
        self.blocks = self._block_pools(num_blocks, window_blocks)
        self.scheduler = Scheduler(cfg, self.blocks)
        caches = allocate_kv_caches(stage_config(local, stage, stages), num_blocks, cfg.block_size, cfg.dtype, device, cfg.kv_cache_dtype,
                                    self.kv_groups, window_blocks)
        for cache, layer in zip(caches, model.layers, strict=True):
            cache.key_smoothing = layer.qk_scale
        if self._workers is not None and stages > 1 and stage == 0:  # each step's hidden states go down the stages
            self.runner = PipelineDriver(self._workers, model, caches, cfg.block_size, self.kv_groups)
        elif self._workers is not None:  # rank 0 of the ranks it started: each step goes to them first
            self.runner = DrivingRunner(self._workers, model, caches, cfg.block_size, self.kv_groups)
        else:
            self.runner = ModelRunner(model, caches, cfg.block_size, self.kv_groups)
        self.offload = self._offload(caches)
        self.spec = make_speculation(cfg, self.tokenizer, ckpt.config.vocab_size, num_blocks, self.max_model_len)
        eos = set(ckpt.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = tuple(sorted(eos))
        self._tracked: dict[str, _Tracked] = {}
        self._retired_adapters: set[str] = set()  # LoRA adapters replaced while requests ran with them
        self._retirements = itertools.count()
        self._pending: list[RequestOutput] = []  # outputs of aborted requests, reported next step
        self._ids = itertools.count()
        self._grammar_compiler: GrammarCompiler | None = None  # built on the first constrained request
        self.held: dict[str, HeldKV] = {}  # KV of finished prefill-only requests, until pulled (kv_handoff)
        self.stats = {"steps": 0, "prompt_tokens": 0, "generation_tokens": 0, "aborted": 0, "step_seconds": 0.0,
                      "rank_restarts": 0, "overlapped_steps": 0}
        self.restarting = False  # while a tensor-parallel group's ranks restart (the server's /health says so)
        # Pipeline stages overlap: up to one batch a stage in flight (not with speculation, whose drafts are
        # proposed for every running request)
        self._overlap = cfg.pipeline_parallel_size > 1 and cfg.pipeline_overlap and stage == 0 and self.spec is None
        self._in_flight: deque[tuple[ScheduledBatch, StepInput]] = deque()
        if self._overlap:
            self.scheduler.microbatches = stages
        # So that it predicts from the first step: stall-free batching needs it, and so does the offload (its
        # load-or-recompute decision and the tier credits it sends a router price recomputing a block with it)
        # (not on a rank that follows rank 0's steps: it schedules nothing, and runs rank 0's calibration steps)
        follows = (group is not None and group.driven and group.rank != 0) or stage != 0
        if (self.scheduler.stall_free or self.offload is not None) and not follows:
            calibrate_step_cost(self)

    def _leads_ranks(self) -> bool:
        """Whether this process starts ranks: the replica's first (tensor-parallel peers and later stages), or a
        later stage's first (its peers). Ranks started or joined from outside are in their group already."""
        cfg = self.cfg
        return ((cfg.tensor_parallel_size > 1 and current_group() is None)
                or (cfg.pipeline_parallel_size > 1 and current_stage() is None))

    def _parallel_group(self) -> "GlooGroup | None":
        """The process's group of tensor-parallel ranks (its stage's, with pipeline parallelism); None without."""
        ranks = self.cfg.tensor_parallel_size
        if ranks == 1:
            return None
        group = current_group()
        if group is None or group.size != ranks:
            raise ConfigError(f"tensor_parallel_size {ranks} does not match this process's group of "
                              f"{group.size if group else 0} ranks", param="tensor_parallel_size")
        return group

    def _lora_adapters(self, model: DecoderModel) -> LoraRegistry | None:
        """The LoRA adapters this engine serves (EngineConfig.lora_adapters), loaded into `model`'s layers."""
        if not self.cfg.lora_adapters:
            return None
        registry = self._new_lora_registry(model)
        for name, adapter_path in self.cfg.lora_adapters.items():
            registry.load(name, adapter_path)
        return registry

    def _new_lora_registry(self, model: DecoderModel) -> LoraRegistry:
        cfg = self.model_config
        if cfg.num_experts or cfg.kv_lora_rank or cfg.model_type not in LORA_FAMILIES:
            raise ConfigError(f"LoRA adapters work with dense {', '.join(LORA_FAMILIES)} models, not "
                              f"{cfg.model_type}{' with experts' if cfg.num_experts else ''}", param="lora_adapters")
        if self._workers is not None or self.cfg.tensor_parallel_size > 1 or self.cfg.pipeline_parallel_size > 1:
            raise ConfigError("model parallelism does not yet work with LoRA adapters", param="lora_adapters")
        model.adapters = LoraRegistry(model, self.cfg.lora_memory, busy=lambda name: self._lora_requests(name) > 0)
        return model.adapters

    def load_lora(self, name: str, path: str) -> LoraAdapter:
        """Serve the adapter at `path` as `name` from the next step on, replacing one of that name. Requests
        running with the old one finish with it (their KV and tokens belong to it): it is renamed for them,
        out of sight of new requests, and unloaded once the last of them is done (`_drop_retired`)."""
        if self.lora is None:
            self._drop_default_invariance("LoRA adapters")
            self.lora = self._new_lora_registry(self.runner.model)
        adapter = load_adapter(name, path, self.lora.model.cfg)  # read first: a bad file changes nothing
        if self._lora_requests(name):
            retired = f"{name}@retired-{next(self._retirements)}"  # unique: the same file may be reloaded twice
            self.lora.rename(name, retired)
            for t in self._tracked.values():
                if t.req.lora == name:
                    t.req.lora = retired
            self._retired_adapters.add(retired)
        return self.lora.serve(name, path, adapter)

    def _drop_retired(self) -> None:
        """Unload the replaced adapters whose last request has finished."""
        for name in [n for n in self._retired_adapters if not self._lora_requests(n)]:
            self._retired_adapters.discard(name)
            self.lora.unload(name)

    def unload_lora(self, name: str) -> None:
        if self.lora is None:
            raise InvalidRequestError(f"unknown LoRA adapter {name!r}: this engine serves none", param="lora_name")
        running = self._lora_requests(name)
        if running:
            raise AdapterBusyError(f"LoRA adapter {name!r} cannot be unloaded while {running} request(s) run with "
                                   f"it", param="lora_name")
        self.lora.unload(name)

    def _bind_adapter(self, req: Request, name: str) -> None:
        """Run `req` with the adapter `name`, loaded for the next step (read again if the memory budget had
        evicted it). Its content, not its name, salts the request's prefix-cache blocks: a reload never meets
        stale KV."""
        if self.lora is None:
            raise InvalidRequestError(f"unknown LoRA adapter {name!r}: this engine serves none", param="model")
        req.lora, req.cache_salt = name, bytes.fromhex(self.lora.acquire(name).digest)

    def _lora_requests(self, name: str) -> int:
        """Requests queued or running with the adapter `name` (none while the engine is being built)."""
        return sum(1 for t in getattr(self, "_tracked", {}).values() if t.req.lora == name)

    def _refuse_batch_invariant(self, model: "ModelConfig") -> None:
        """Asked for, the batch-invariant path must cover the model's layers (models/invariance.py)."""
        kind = model_gap(model) if self.cfg.batch_invariant else None
        if kind is not None:
            raise ConfigError(f"batch_invariant does not cover {model.model_type}'s {kind} yet", param="batch_invariant")

    def _batch_invariant(self, model: Any) -> bool:
        """Whether this engine's outputs are batch-invariant: asked for, or by default where it costs nothing."""
        if self.cfg.batch_invariant is not None:
            return self.cfg.batch_invariant
        free = (not self.cfg.batch_invariant_gaps() and model_gap(model.cfg) is None and isinstance(model, DecoderModel)
                and invariant_by_default(model))
        if free:
            log.info("batch-invariant bf16 on: on this CPU the default kernels keep each row's sums in one order")
        return free

    def _drop_default_invariance(self, what: str) -> None:
        """`what` is outside the batch-invariant path: refused if it was asked for, else the default is dropped."""
        if self.cfg.batch_invariant:
            raise ConfigError(f"batch_invariant does not cover {what}", param="batch_invariant")
        if self.batch_invariant:
            log.info("batch-invariant bf16 off from now on: it does not cover %s", what)
            self.batch_invariant = self.runner.model.batch_invariant = False

    def _refuse_idle_dynamic_quant(self, model: Any) -> None:
        """--dynamic-quant acts on low-bit weights only; on a model without any it would silently do nothing."""
        if self.cfg.dynamic_quant and not any(getattr(w, "int8_activations", False)
                                              for layer in model.layers for w in vars(layer).values()):
            raise ConfigError("dynamic_quant acts on low-bit weights, and this model has none: set quantization "
                              "(or load a quantized checkpoint)", param="dynamic_quant")

    def _refuse_with_parallelism(self, model: "ModelConfig") -> None:
        cfg = self.cfg
        if cfg.enable_expert_parallel and cfg.tensor_parallel_size == 1:
            raise ConfigError("expert parallelism shares the experts out over the tensor-parallel ranks: set "
                              "tensor_parallel_size above 1", param="enable_expert_parallel")
        if cfg.tensor_parallel_size == 1 and cfg.pipeline_parallel_size == 1:
            return
        if cfg.tensor_parallel_size > 1:
            check_tensor_parallel(model, cfg.tensor_parallel_size, cfg.enable_expert_parallel)
        if cfg.pipeline_parallel_size > 1:
            check_pipeline_parallel(model, cfg.pipeline_parallel_size)
        for name, value, why in (("kv_offload_host_memory", cfg.kv_offload_host_memory or cfg.kv_offload_disk
                                  or cfg.kv_offload_redis, "offload tiers"),
                                 ("kv_cache_dtype", cfg.kv_cache_dtype == "int8", "an int8 KV cache"),
                                 ("speculative_method", cfg.speculative_method == "speculator", "a speculator"),
                                 ("lora_adapters", cfg.lora_adapters, "LoRA adapters")):
            if value:
                raise ConfigError(f"model parallelism does not yet work with {why}", param=name)

    def _start_ranks(self) -> Workers:
        """Start this process's tensor-parallel peers (of its stage) and, on stage 0, the later stages, and be
        their rank 0."""
        cfg = self.cfg
        stage, stages = current_stage() or (0, cfg.pipeline_parallel_size)
        placement = current_placement(cfg.tensor_parallel_size) if stages == 1 else None
        if placement is not None:  # a replica placed by Ray with a bundle per rank: rank actors in them
            return start_ray_ranks(cfg, cfg.tensor_parallel_size, placement)
        workers = Workers([], [])
        cpus = replica_cpus()
        with cpus_for_children(cpus):
            if cfg.tensor_parallel_size > 1:
                workers = start_workers(cfg, cfg.tensor_parallel_size, (stage, stages))
            if stage == 0 and stages > 1:
                try:
                    workers = workers.with_stages(start_stages(cfg, stages))
                except BaseException:
                    workers.stop(timeout=1)
                    raise
        if stage == 0:  # the replica's first process (later stages bind themselves as they start)
            workers.affinity = bind_replica_process(cfg, 0, cpus)
        return workers

    def _offload(self, caches: "list[LayerKV]") -> "KVOffload | None":
        cfg = self.cfg
        if not (cfg.kv_offload_host_memory or cfg.kv_offload_disk or cfg.kv_offload_redis):
            return None
        if not cfg.enable_prefix_caching or self.kv_groups != KVGroups() or self.model_config.is_mla:
            raise ConfigError("KV offload needs the prefix cache, and one KV pool of per-head K and V (no "
                              "sliding-window pools or latent caches yet)", param="kv_offload_host_memory")
        from kvyard.disagg.blocks import layer_tensors
        from kvyard.engine.block_manager import HASH_FUNCTION
        from kvyard.offload.decision import LoadOrRecompute
        from kvyard.offload.disk_tier import DiskTier, kv_fingerprint
        from kvyard.offload.host_tier import HostTier
        from kvyard.offload.manager import KVOffload, Tier

        bs = cfg.block_size
        layout = [[((bs, *t.shape[1:]), t.dtype) for t in layer_tensors(c)] for c in caches]
        # The model by its file's name and size (replicas may hold it at other paths), and all that shapes its KV
        fingerprint = kv_fingerprint(self.model_path.name, _size_of(self.model_path), str(cfg.dtype),
                                     cfg.quantization, cfg.kv_cache_dtype, HASH_FUNCTION, layout)
        tiers: list[Tier] = []
        if cfg.kv_offload_host_memory:
            tiers.append(HostTier(int(cfg.kv_offload_host_memory), layout, segment_path=_segment_path(cfg, fingerprint),
                                  fingerprint=fingerprint))
        if cfg.kv_offload_disk:
            if cfg.kv_offload_tiers == "inclusive" and cfg.kv_offload_disk_capacity <= cfg.kv_offload_host_memory:
                raise ConfigError(f"with inclusive KV tiers the disk ({cfg.kv_offload_disk_capacity} bytes) must be "
                                  f"larger than the host tier ({cfg.kv_offload_host_memory} bytes) to add capacity; "
                                  "raise --kv-offload-disk-capacity or use --kv-offload-tiers exclusive",
                                  param="kv_offload_disk_capacity")
            tiers.append(DiskTier(Path(cfg.kv_offload_disk), int(cfg.kv_offload_disk_capacity), layout, fingerprint))
        if cfg.kv_offload_redis:
            from kvyard.offload.redis_tier import RedisTier

            tiers.append(RedisTier(cfg.kv_offload_redis, layout, fingerprint))
        decide = LoadOrRecompute(self.scheduler.cost, bs, cfg.kv_offload_decision,
                                 seconds_per_token=self._seconds_per_token)
        offload = KVOffload(tiers, caches, self.blocks, cfg.block_size, decide, cfg.kv_offload_write,
                            cfg.kv_offload_admit_after, cfg.kv_offload_tiers == "exclusive",
                            overlap=cfg.kv_offload_load == "overlap")
        self.scheduler.restorer = offload
        return offload

    def _seconds_per_token(self) -> float | None:
        """Mean wall time per token of the steps so far, restores from the offload tiers left out (None before
        the first step)."""
        tokens = self.stats["prompt_tokens"] + self.stats["generation_tokens"]
        restoring = self.offload.seconds_restoring if self.offload is not None else 0.0
        return (self.stats["step_seconds"] - restoring) / tokens if tokens else None

    def _block_pools(self, num_blocks: int, window_blocks: int) -> BlockManager:
        cfg, groups = self.cfg, self.kv_groups
        if groups.window is not None:
            return WindowBlocks(num_blocks, cfg.block_size, groups.window, cfg.enable_prefix_caching,
                                sinks=groups.sinks)
        if groups.sliding_window is not None:
            log.info("KV pools: %d blocks for the full-attention layers, %d for the %d sliding-window layers",
                     num_blocks, window_blocks, len(groups.sliding_layers))
            return HybridBlocks(num_blocks, window_blocks, cfg.block_size, groups.sliding_window,
                                cfg.enable_prefix_caching, sinks=groups.sinks)
        return BlockManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching)

    def _weights(self, ckpt: Checkpoint) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
        if self.cfg.quantization == KEEP_GGUF:
            log.info("%s: %d linear weights kept in their GGUF blocks (loader/gguf_native.py), the rest dense",
                     ckpt.path.name, ckpt.native_layers)
        return served_tensors(ckpt, self.cfg.quantization)

    # ---- admission -----------------------------------------------------------------------------------

    def tokenize(self, prompt: str) -> list[int]:
        return self.tokenizer(prompt, add_special_tokens=True).input_ids

    def add_request(
        self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None,
        hold_kv: bool = False, lora: str | None = None, soft_tokens: list[SoftTokens] | None = None,
    ) -> str:
        """Queue a request; `hold_kv` keeps its full KV blocks when it finishes (see `held`); `lora` names
        the LoRA adapter it runs with; `soft_tokens` give prompt positions their embeddings (an image's)."""
        params = params or SamplingParams()
        params.validate()
        text = prompt if isinstance(prompt, str) else None
        ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        self._check_prompt(ids)
        self._check_token_ids(params)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._tracked:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        req = Request(request_id, ids, params, prompt=text, eos_token_ids=self.eos_token_ids, hold_kv=hold_kv)
        if soft_tokens:
            check_spans(soft_tokens, len(ids), self.model_config.hidden_size)
            req.soft_tokens = sorted(soft_tokens, key=lambda s: s.start)
        if lora is not None:
            self._bind_adapter(req, lora)
        if params.structured_output is not None:
            req.grammar = self._grammar_state(params.structured_output)
            if req.grammar.tokens_to_close(params.max_tokens) is None:
                raise InvalidRequestError(
                    f"max_tokens {params.max_tokens} is too small for this response format: its shortest "
                    f"valid output takes more tokens", param="max_tokens")
        detok = Detokenizer(self._fast_tokenizer, ids, params.stop, params.skip_special_tokens)
        repetition = None
        if params.repetition_detection is not None:
            repetition = RepetitionDetector(params.repetition_detection, self._fast_tokenizer)
        self._tracked[request_id] = _Tracked(req, detok, repetition=repetition)
        self.scheduler.add(req)
        return request_id

    @property
    def grammar_compiler(self) -> "GrammarCompiler":
        """The compiler for this model's vocabulary (built lazily: xgrammar scans the whole vocabulary)."""
        if self._grammar_compiler is None:
            from kvyard.structured.compiler import GrammarCompiler

            cfg = self.model_config
            self._grammar_compiler = GrammarCompiler(self.tokenizer, cfg.vocab_size, self.eos_token_ids)
        return self._grammar_compiler

    def _grammar_state(self, spec: StructuredOutput) -> "GrammarState":
        from kvyard.structured.matcher import GrammarState

        # The server attaches the compiled grammar (compiled off this thread); the offline API compiles here,
        # before the request joins a step.
        compiled = spec.compiled if spec.compiled is not None else self.grammar_compiler.compile(spec)
        return GrammarState(compiled)

    def _check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})", param="prompt")
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {len(ids)} tokens; this model's context is {self.max_model_len} tokens "
                "including at least one generated token",
                param="prompt",
            )

    def _check_token_ids(self, params: SamplingParams) -> None:
        # The sampler indexes logits with these; an id past the vocabulary must never reach it.
        vocab = self.model_config.vocab_size
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or ())):
            if any(t >= vocab for t in ids):
                raise InvalidRequestError(f"{name}: token ids must be below the vocabulary size {vocab}",
                                          param=name)

    def abort_request(self, request_id: str) -> bool:
        tracked = self._tracked.get(request_id)
        if tracked is None or tracked.req.finished:
            return False
        self.scheduler.finish(tracked.req, "abort")
        self._pending.append(self._output(tracked))
        self.stats["aborted"] += 1
        return True

    def enable_kv_events(self) -> set[bytes]:
        """Record the prefix cache's and the offload tiers' changes; returns the pool's cached hashes now."""
        if self.offload is not None:
            self.offload.enable_events()
        return self.blocks.enable_events()

    def take_kv_events(self) -> list[KVEvent]:
        events = self.blocks.take_events()
        if self.offload is not None:
            events += self.offload.take_events()
        return events

    def _restart_ranks(self) -> None:
        """Stop the other ranks and start them again, as a gang. Their KV caches start empty, so every request
        still running is preempted (its prompt recomputed) and the prefix cache forgets what it held."""
        assert self._workers is not None
        log.error("a step of this parallel replica failed; restarting its %d other ranks", len(self._workers.processes))
        self.restarting = True
        try:
            self._workers.stop(timeout=2)
            self._workers = None
            self._workers = self._start_ranks()
            self.runner.restart(self._workers)  # type: ignore[attr-defined]
            self.scheduler.preempt_all()
            self.blocks.forget_cached()
            self.stats["rank_restarts"] += 1
        finally:
            self.restarting = False

    def close(self) -> None:
        """Stop the ranks this engine started (tensor parallelism); nothing to do otherwise."""
        if self._workers is not None:
            self._workers.stop()
            self._workers = None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work() or bool(self._pending)

    # ---- stepping ------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        if self._retired_adapters:
            self._drop_retired()
        restoring_before = self.offload.seconds_restoring if self.offload is not None else 0.0
        outputs, self._pending = self._pending, []
        if self.spec is not None:
            self.spec.propose(self.scheduler.running)  # drafts in req.spec_token_ids, budgeted by schedule()
        with record_function("kvyard.schedule"):  # phases, for `kvyard bench step-profile`
            batch = self.scheduler.schedule()
        if self.offload is not None:  # blocks evicted while scheduling, out before the forward pass reuses them
            self.offload.write_queued()
        if self._overlap and (batch.requests or self._in_flight):
            return self._overlapped_step(batch, outputs)
        if not batch.requests:
            if self.offload is not None:  # nothing runs: wait for a waiting request's blocks, not in a busy loop
                self.offload.wait_for_reads(READ_WAIT_S)
            return outputs
        executed = False
        try:
            with record_function("kvyard.prepare"):
                step = self.runner.prepare(batch)
            with record_function("kvyard.forward"):
                logits = self.runner.execute(step)
            executed = True
            sampled = self._sample(step, logits)
        except Exception:
            self._fail_steps([batch], outputs, restart=not executed)
            return outputs
        self._emit_step(batch, sampled, outputs)
        # The whole step, as a running stream waits for it: drafting, scheduling, the forward pass, sampling;
        # the cost model leaves out restoring blocks from the offload tiers: it is what their loads are weighed
        # against (a 2,000-token restore in a 16-token step taught it that tokens cost next to nothing).
        seconds = time.perf_counter() - started
        restoring = self.offload.seconds_restoring - restoring_before if self.offload is not None else 0.0
        self.scheduler.cost.observe(batch.shape, seconds - restoring)
        self.stats["step_seconds"] += seconds
        return outputs

    def _overlapped_step(self, batch: ScheduledBatch, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Pipeline stages with batches in flight: launch this step's batch into stage 0, and take the oldest
        batch's logits once the pipeline holds as many batches as it has stages (or nothing new came). The
        scheduler passes over the requests in flight, so each batch is a different set of requests."""
        started = time.perf_counter()
        involved = [b for b, _ in self._in_flight] + ([batch] if batch.requests else [])
        try:
            if batch.requests:
                step = self.runner.prepare(batch)
                self.runner.launch(step)  # type: ignore[attr-defined]
                self.stats["overlapped_steps"] += bool(self._in_flight)  # launched while another batch is in
                self.scheduler.in_flight.update(req.request_id for req in batch.requests)
                self._in_flight.append((batch, step))
            if not self._in_flight or (batch.requests and len(self._in_flight) < self.cfg.pipeline_parallel_size):
                return outputs  # room in the pipeline: the next step launches another batch first
            done, step = self._in_flight.popleft()
            logits = self.runner.collect()  # type: ignore[attr-defined]
            self.scheduler.in_flight.difference_update(req.request_id for req in done.requests)
            sampled = self._sample(step, logits)
        except Exception:
            self._in_flight.clear()
            self.scheduler.in_flight.clear()
            self._fail_steps(involved, outputs, restart=True)
            return outputs
        self._emit_step(done, sampled, outputs)
        self.stats["step_seconds"] += time.perf_counter() - started
        return outputs

    def _sample(self, step: "StepInput", logits: torch.Tensor) -> tuple[list[Request], Any, list]:
        if step.prompt_rows:  # rows past the sampled ones: prompt positions to score
            sampled_rows = sum(step.num_rows)
            record_prompt_logprobs(logits[sampled_rows:], step.prompt_rows)
            logits = logits[:sampled_rows]
        with record_function("kvyard.sample"):
            plain, plain_logits, verifying = split_logits(step.sampled, step.num_rows, logits)
            return plain, sample(plain_logits, plain), verifying

    def _fail_steps(self, batches: list[ScheduledBatch], outputs: list[RequestOutput], restart: bool) -> None:
        """A failure inside the model or sampler ends these steps' requests, never the engine."""
        requests = [req for batch in batches for req in batch.requests if not req.finished]
        log.exception("step failed; finishing its %d requests with an error", len(requests))
        for req in requests:
            self.scheduler.finish(req, "error")
            outputs.append(self._output(self._tracked[req.request_id]))
        if self._workers is not None and restart:
            # A rank may be gone, or left mid-collective: the ranks no longer step together
            self._restart_ranks()

    def _emit_step(self, batch: ScheduledBatch, sampled: tuple[list[Request], Any, list],
                   outputs: list[RequestOutput]) -> None:
        plain, result, verifying = sampled
        self.stats["steps"] += 1
        for req, n in zip(batch.requests, batch.num_new_tokens, strict=True):
            if req.finished:
                continue  # aborted while its batch was in the pipeline: its blocks are gone
            # Drafts only count as computed once verified (below): blocks holding them are not committed.
            req.num_computed_tokens += n - len(req.spec_token_ids)
            self.blocks.commit(req)
        now = time.monotonic()
        with record_function("kvyard.emit"):  # detokenization, stop checks, outputs
            for req, token, logprob in zip(plain, result.token_ids, result.logprobs, strict=True):
                if req.finished:
                    continue
                tracked = self._tracked[req.request_id]
                self._emit(tracked, token, logprob, now)
                outputs.append(self._output(tracked))
            for req, rows in verifying:
                outputs.append(self._verify(req, rows, now))

    def _verify(self, req: Request, rows: torch.Tensor, now: float) -> RequestOutput:
        """Emit what a speculating request's rows accept; its KV then covers only the accepted drafts."""
        assert self.spec is not None
        tracked = self._tracked[req.request_id]
        drafts, req.spec_token_ids = req.spec_token_ids, []
        before = req.num_tokens
        accepted = verify(req, rows, drafts, lambda token, logprob: self._emit(tracked, token, logprob, now))
        self.spec.record(req, len(drafts), accepted, req.num_tokens - before)
        if not req.finished:
            # The rejected drafts' KV stays in its slots and is overwritten by the next tokens.
            req.num_computed_tokens += accepted
            self.blocks.commit(req)
        return self._output(tracked)

    def _emit(self, tracked: _Tracked, token: int, logprob: TokenLogprob | None, now: float) -> bool:
        """Append one generated token and apply the stop conditions; True when the request finished."""
        req = tracked.req
        if req.first_token_time is None:
            req.first_token_time = now
            self.stats["prompt_tokens"] += req.num_prompt_tokens
        req.token_ids.append(token)
        self.stats["generation_tokens"] += 1
        if req.grammar is not None and not req.grammar.accept(token):
            # Masking makes this impossible; if it happens anyway, fail loudly rather than emit bad output.
            log.error("%s: token %d is not allowed by its grammar", req.request_id, token)
            self.scheduler.finish(req, "error")
            return True
        if logprob is not None:
            req.logprobs.append(logprob)
        tracked.detok.add(token)
        reason = self._stop_reason(req, token, tracked.detok, tracked.repetition)
        if reason is not None:
            self.scheduler.finish(req, reason)
            return True
        return False

    def _stop_reason(self, req: Request, token: int, detok: Detokenizer,
                     repetition: RepetitionDetector | None = None) -> str | None:
        p = req.params
        if req.grammar is not None and req.grammar.terminated:
            # The grammar is complete and accepted a stop token: nothing may follow. "length" says the budget
            # steered it to close (the output is still complete and valid).
            return "length" if req.grammar.budget_forced else "stop"
        # The detector sees every token (its state is the tail), but like a stop it acts after min_tokens.
        looped = repetition is not None and repetition.add(token, detok.text) is not None
        if req.num_output_tokens >= p.min_tokens:
            if not p.ignore_eos and token in req.eos_token_ids:
                return "stop"
            if token in p.stop_token_ids:
                req.stop_reason = token
                return "stop"
            if detok.stop_hit is not None:
                req.stop_reason = detok.stop_hit
                return "stop"
            if looped:
                log.debug("%s loops: %s", req.request_id, repetition.found)  # type: ignore[union-attr]
                return "repetition"
        if req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _output(self, tracked: _Tracked) -> RequestOutput:
        req = tracked.req
        out_ids = req.output_token_ids
        delta_ids = out_ids[tracked.tokens_sent :]
        tracked.tokens_sent = len(out_ids)
        finished = req.finished
        delta_text = tracked.detok.take_delta(finished)
        completion = CompletionOutput(
            index=0,
            text=tracked.detok.text if finished else tracked.detok.text[: tracked.detok.sent],
            token_ids=out_ids,
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
            logprobs=None if req.logprobs is None else list(req.logprobs),  # the engine keeps appending
            delta_text=delta_text,
            delta_token_ids=delta_ids,
        )
        metrics = {"arrival_time": req.arrival_time}
        if req.first_token_time is not None:
            metrics["first_token_time"] = req.first_token_time
        if finished:
            del self._tracked[req.request_id]
            if req.held_blocks:
                n = len(req.held_blocks)
                self.held[req.request_id] = HeldKV(req.request_id, req.held_blocks, req.block_hashes[:n],
                                                   req.token_ids[: n * self.cfg.block_size])
        # Complete before the first token is sampled, and never changed after: shared, not copied per output.
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [completion], finished, metrics,
                             prompt_logprobs=req.prompt_logprobs)

    # ---- KV handoff (prefill/decode disaggregation) ---------------------------------------------------

    def release_kv(self, request_id: str) -> bool:
        """Drop the hold on a finished request's KV blocks (pulled, or given up on)."""
        held = self.held.pop(request_id, None)
        if held is None:
            return False
        self.blocks.release(held.block_ids)
        return True

    def adopt_kv(self, token_ids: list[int], block_hashes: list[bytes], tensors: list[list[torch.Tensor]],
                 valid_until: float = math.inf) -> int:
        """Put KV blocks computed by another worker into the prefix cache; returns how many were new.

        `tensors` is per layer, block after block (kvyard/disagg/blocks.py). A request for the same prompt
        added after this hits the blocks like any cached prefix. `valid_until` (monotonic): after then,
        `tensors` (another process's shared memory) may have been rewritten, so a copy that ends later is
        discarded (KVIntegrityError).
        """
        from kvyard.disagg.blocks import scatter_blocks
        from kvyard.disagg.payload import KVIntegrityError

        taken = self.blocks.adopt(token_ids, block_hashes)
        if not taken:
            return 0
        ids = [b for _, b in taken]
        try:
            scatter_blocks(self.runner.kv_caches, ids, self.cfg.block_size,
                           select_blocks(tensors, [i for i, _ in taken], self.cfg.block_size))
            if time.monotonic() > valid_until:
                raise KVIntegrityError(f"received KV was copied after its lease ran out ({len(ids)} blocks dropped)")
        except BaseException:
            self.blocks.forget(ids)  # never leave a registered block holding KV it did not get
            raise
        finally:
            self.blocks.release(ids)
        return len(ids)

    # ---- scoring -------------------------------------------------------------------------------------

    @torch.inference_mode()
    def compute_logits(self, token_ids: list[int], all_positions: bool = False, lora: str | None = None
                       ) -> torch.Tensor:
        """fp32 logits of one prompt in one forward pass, outside the scheduler (with the LoRA adapter `lora`).

        For parity checks and fidelity measurement (KL, perplexity). Returns [vocab] for the last
        position, or [positions, vocab]. The blocks it borrows are returned before it returns.
        """
        self._check_prompt(token_ids)
        req = Request("score", token_ids, SamplingParams(max_tokens=1, temperature=0.0))
        if lora is not None:
            self._bind_adapter(req, lora)
        if not self.blocks.can_fit(req, len(token_ids)):
            raise PromptTooLongError("not enough free KV blocks to score this prompt now", param="prompt")
        self.blocks.grow(req, len(token_ids))
        if self.offload is not None:
            self.offload.write_queued()
        try:
            batch = ScheduledBatch()
            batch.add(req, len(token_ids))
            step = self.runner.prepare(batch)
            if all_positions:
                step.logits_indices = torch.arange(len(token_ids), device=step.logits_indices.device)
            logits = self.runner.execute(step)
        finally:
            self.blocks.free(req)
        return logits if all_positions else logits[0]


def _segment_path(cfg: EngineConfig, fingerprint: str) -> Path | None:
    """The host tier's shared-memory file (kvyard/offload/host_segment.py), or None: private memory."""
    where = cfg.kv_offload_host_segment
    if where in ("", "off", "none"):
        return None
    if where == "auto":
        return Path(os.environ.get("KVYARD_SHM_DIR", "/dev/shm")) / f"kvyard-kv-{fingerprint}"
    return Path(where)


def _size_of(path: Path) -> int:
    """Bytes of a checkpoint file, or of a directory's files."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
