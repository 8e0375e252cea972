"""`AsyncEngine`: the synchronous `LLMEngine` driven by a thread of its own, fed from asyncio.

Threading model. The engine is not thread-safe, so exactly one thread, the engine thread, ever touches
it, from building it on (so that one thread makes all of the process's parallel torch calls, see
`__init__`). Everything else talks to that thread through two one-way channels:

* commands in: a `queue.SimpleQueue` of `_Add` / `_Abort` / `_Stop`. An add carries a
  `concurrent.futures.Future` that the engine thread resolves with the outcome of `add_request`, so a
  validation error (`InvalidRequestError`, `PromptTooLongError`) reaches the caller as the same typed
  exception.
* outputs out: each request has an asyncio queue (its "sink") on the caller's event loop; the engine
  thread hands it every `RequestOutput` with `loop.call_soon_threadsafe`.

Torch releases the GIL inside its kernels, so while the engine thread runs a forward pass the event loop
keeps parsing HTTP, tokenizing and streaming. When the engine has nothing to do, its thread blocks on the
command queue and costs nothing.

Towards a separate engine process (vLLM's API-server / engine-core split): the front end already
uses only values that could be pickled (prompt token ids, `SamplingParams`, request ids, `RequestOutput`,
`EngineStats`) and never reaches into the engine. Replacing the two queues with sockets and the thread
with a process would leave `add_request`, `generate`, `abort`, `stats` and `shutdown` unchanged. The front
end also owns its own tokenizer (`self.tokenizer`, a copy), as the API server does in that split.
"""

import asyncio
import concurrent.futures
import copy
import dataclasses
import itertools
import logging
import math
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvyard.config import EngineConfig
from kvyard.engine.kv_events import KVEvent
from kvyard.engine.kv_handoff import HeldKV
from kvyard.engine.llm_engine import LLMEngine
from kvyard.engine.soft_tokens import SoftTokens
from kvyard.errors import EngineDeadError, KvyardError
from kvyard.lora.stack import ServedAdapter
from kvyard.models.moe import routing_stats
from kvyard.outputs import RequestOutput
from kvyard.parallel.expert import rank_loads
from kvyard.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class RequestFailedError(KvyardError):
    """An accepted request ended without a result: its engine step failed or the engine stopped."""

    def __init__(self, request_id: str, message: str):
        super().__init__(message)
        self.request_id = request_id


# What a sink receives: an output, or the error that ends the request.
SinkItem = RequestOutput | RequestFailedError


@dataclass(frozen=True)
class EngineStats:
    """A snapshot published by the engine thread after every step; reading it never touches the engine."""

    num_running: int = 0
    num_waiting: int = 0  # in the scheduler's queue
    num_pending: int = 0  # submitted, not yet taken in by the engine thread
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_preemptions: int = 0
    num_limited_chunks: int = 0  # prompt chunks shortened to keep running streams within the inter-token target
    prefix_cache_queried_tokens: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hit_tokens: int = 0  # of which were found, so not prefilled again
    num_cached_blocks: int = 0
    num_steps: int = 0
    step_seconds: float = 0.0  # time inside engine steps: against wall time, how busy the engine thread is
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_open_requests: int = 0  # accepted requests whose final output has not been delivered yet
    num_held_kv: int = 0  # finished prefill-only requests whose KV waits to be pulled (disaggregation)
    num_aborted: int = 0  # requests the engine aborted before they finished (clients gone, cancellations)
    rank_restarts: int = 0  # times a tensor-parallel group's other ranks were restarted as a gang
    # Speculative decoding (kvyard/spec/stats.py); all zero when it is off.
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_verify_steps: int = 0
    spec_emitted_tokens: int = 0
    spec_drafter_seconds: float = 0.0
    # Mixture of Experts (kvyard/models/moe.py): tokens routed to each expert, summed over layers, and imbalance
    moe_expert_tokens: tuple[int, ...] = ()
    moe_imbalance: float = 0.0
    moe_rank_tokens: tuple[int, ...] = ()  # expert parallelism: tokens routed to the experts each rank holds
    # KV offload (kvyard/offload/manager.py KVOffload.snapshot): per tier, its counters
    offload: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    # blocks the tiers held that were loaded, or recomputed as cheaper; the prefill time loading saved (estimated)
    offload_loaded: int = 0
    offload_recomputed: int = 0
    offload_saved_seconds: float = 0.0
    offload_not_admitted: int = 0
    offload_credits: dict[str, float] = dataclasses.field(default_factory=dict)  # per tier, for a router
    block_size: int = 16


@dataclass
class _Sink:
    loop: asyncio.AbstractEventLoop
    queue: "asyncio.Queue[SinkItem]"

    def put(self, item: SinkItem) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:
            pass  # the caller's loop is closed: nobody is left to read this


@dataclass
class ReceivedKV:
    """KV blocks pulled from a prefill worker, to adopt into the prefix cache just before the request."""

    token_ids: list[int]
    block_hashes: list[bytes]
    tensors: list[list[torch.Tensor]]  # per layer, block after block (kvyard/disagg/blocks.py)
    valid_until: float = math.inf  # `tensors` may be the transport's memory, readable until then
    finish: Callable[[str | None], None] = lambda problem: None  # tell the transport we are done (idempotent)


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    sink: _Sink
    done: "concurrent.futures.Future[None]"
    hold_kv: bool = False
    received: ReceivedKV | None = None
    lora: str | None = None
    soft_tokens: list[SoftTokens] | None = None


@dataclass
class _Call:
    """Run `fn` on the engine thread, between steps (what changes the model must not race a step)."""

    fn: Callable[[LLMEngine], Any]
    done: "concurrent.futures.Future[Any]"


@dataclass
class _HeldKV:
    request_id: str
    release: bool  # True: drop the hold; False: report it
    done: "concurrent.futures.Future[HeldKV | None] | None" = None


@dataclass
class _Abort:
    request_id: str


class _Stop:
    pass


@dataclass
class _EnableKVEvents:
    # Called on the engine thread with each step's KV events; must only enqueue (kvyard/server/kv_events.py).
    sink: Callable[[list[KVEvent]], None]
    done: "concurrent.futures.Future[set[bytes]]"


class AsyncEngine:
    def __init__(self, build: Callable[[], LLMEngine]):
        """Start the engine thread, which calls `build` and then serves; raises what `build` raised.

        The engine is built on its own thread, not the caller's, so that every parallel torch call of the
        process comes from one thread. libgomp keeps a pool of workers per thread that starts parallel
        regions; with a second pool alive (the caller's, from building the model) it counts more threads
        than cores and its workers stop spinning between regions and sleep instead. Each parallel call
        then waits for a wake-up: SmolLM2 int4 decode steps took 18-20 ms on the engine thread against
        5.5-6 ms on the thread that built the model (BENCHMARKS.md, session 21).
        """
        self._commands: queue.SimpleQueue[_Add | _Abort | _Stop | _EnableKVEvents | _HeldKV] = queue.SimpleQueue()
        self._kv_sink: Callable[[list[KVEvent]], None] | None = None
        self._sinks: dict[str, _Sink] = {}  # engine thread only
        self._pending = 0
        self._pending_lock = threading.Lock()
        self._ids = itertools.count()
        self._stats = EngineStats()
        self._stopped = threading.Event()
        built: concurrent.futures.Future[LLMEngine] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(build, built), name="kvyard-engine", daemon=True)
        self._thread.start()
        engine = built.result()  # the engine thread has set self._engine
        # Front-end copies of what callers need, so they never read engine state from another thread.
        self.tokenizer = copy.deepcopy(engine.tokenizer)
        self.model_config = engine.model_config
        self.generation_defaults = dict(engine.generation_defaults)
        self.max_model_len = engine.max_model_len
        self.batch_invariant = engine.batch_invariant  # off once a LoRA adapter is loaded (load_lora)
        self.model_name = engine.cfg.model
        # The LoRA adapters served (a copy of the engine's registry); changed only by load_lora / unload_lora
        self.lora_adapters: dict[str, ServedAdapter] = dict(engine.lora.served) if engine.lora else {}
        self.engine_config = engine.cfg
        self.block_size = engine.cfg.block_size
        self.enable_prefix_caching = engine.cfg.enable_prefix_caching
        # The KV tensors themselves, for the KV transfer layer's thread (kvyard/disagg/): it reads only
        # blocks the engine holds for it, which the engine never writes while they are held.
        self.kv_caches = engine.runner.kv_caches
        self.kv_groups = engine.kv_groups

    @classmethod
    def from_config(cls, cfg: EngineConfig) -> "AsyncEngine":
        return cls(lambda: LLMEngine(cfg))

    # ---- the front-end API (event loop side) ----------------------------------------------------------

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopped.is_set()

    @property
    def restarting(self) -> bool:
        """Whether the engine is restarting its tensor-parallel ranks (requests wait; /health says 503)."""
        engine = getattr(self, "_engine", None)
        return bool(engine is not None and engine.restarting)

    def offload_credits(self) -> dict[str, float]:
        """Per offload tier (KV-event medium), the credit a router gives its blocks (from any thread)."""
        return self._stats.offload_credits

    def stats(self) -> EngineStats:
        # The pending count moves on both sides of the queue; read it live, not from the last snapshot.
        return dataclasses.replace(self._stats, num_pending=self._pending)

    async def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        sink: "asyncio.Queue[SinkItem] | None" = None,
        hold_kv: bool = False,
        received: ReceivedKV | None = None,
        lora: str | None = None,
        soft_tokens: list[SoftTokens] | None = None,
    ) -> "asyncio.Queue[SinkItem]":
        """Submit a request; return the queue its outputs arrive on once the engine has accepted it.

        Several requests may share one `sink` (their outputs carry their request ids). Raises the
        engine's typed error when it rejects the request. `hold_kv` keeps its KV when it finishes (see
        `held_kv`); `received` KV is adopted into the prefix cache first (prefill/decode disaggregation);
        `lora` names the LoRA adapter it runs with; `soft_tokens` give prompt positions their embeddings.
        """
        if not self.is_running:
            if received is not None:
                received.finish(None)
            raise EngineDeadError("the engine is not running")
        request_id = request_id or f"async-{next(self._ids)}"
        sink = sink if sink is not None else asyncio.Queue()
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        with self._pending_lock:
            self._pending += 1
        self._commands.put(_Add(request_id, prompt, params, _Sink(asyncio.get_running_loop(), sink), done,
                                hold_kv, received, lora, soft_tokens))
        try:
            await asyncio.wrap_future(done)
        except asyncio.CancelledError:
            # The add may still be taken in after we stop waiting; an abort queued behind it undoes it.
            self.abort_nowait(request_id)
            raise
        return sink

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None, hold_kv: bool = False
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until the final one; leaving early aborts the request."""
        request_id = request_id or f"async-{next(self._ids)}"
        sink = await self.add_request(prompt, params, request_id, hold_kv=hold_kv)
        finished = False
        try:
            while not finished:
                item = await sink.get()
                if isinstance(item, RequestFailedError):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort_nowait(request_id)

    def enable_kv_events(self, sink: Callable[[list[KVEvent]], None]) -> "concurrent.futures.Future[set[bytes]]":
        """From now on hand every step's KV events to `sink` (on the engine thread); the future gives the
        block hashes cached at that moment, the state the events start from."""
        done: concurrent.futures.Future[set[bytes]] = concurrent.futures.Future()
        self._commands.put(_EnableKVEvents(sink, done))
        return done

    async def held_kv(self, request_id: str) -> HeldKV | None:
        """The blocks a finished `hold_kv` request kept (None when it kept none)."""
        done: concurrent.futures.Future[HeldKV | None] = concurrent.futures.Future()
        self._commands.put(_HeldKV(request_id, release=False, done=done))
        return await asyncio.wrap_future(done)

    def release_kv_nowait(self, request_id: str) -> None:
        """Drop a finished request's held KV blocks; callable from any thread (the transfer layer's)."""
        self._commands.put(_HeldKV(request_id, release=True))

    async def load_lora(self, name: str, path: str) -> None:
        """Serve the LoRA adapter at `path` as `name` (read on the engine thread, between steps)."""
        adapter, self.batch_invariant = await self._on_engine_thread(
            lambda engine: (engine.load_lora(name, path), engine.batch_invariant))
        self.lora_adapters[name] = ServedAdapter(str(adapter.path), adapter.digest)

    async def unload_lora(self, name: str) -> None:
        await self._on_engine_thread(lambda engine: engine.unload_lora(name))
        self.lora_adapters.pop(name, None)

    async def _on_engine_thread(self, fn: Callable[[LLMEngine], Any]) -> Any:
        if not self.is_running:
            raise EngineDeadError("the engine is not running")
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._commands.put(_Call(fn, done))
        return await asyncio.wrap_future(done)

    def abort_nowait(self, request_id: str) -> None:
        """Abort from anywhere, without awaiting (safe in `finally` blocks of cancelled tasks)."""
        self._commands.put(_Abort(request_id))

    async def abort(self, request_id: str) -> None:
        self.abort_nowait(request_id)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; requests still open end with `RequestFailedError`."""
        if self._thread.is_alive():
            self._commands.put(_Stop())
            self._thread.join(timeout)

    # ---- the engine thread ------------------------------------------------------------------------------

    def _run(self, build: Callable[[], LLMEngine], built: "concurrent.futures.Future[LLMEngine]") -> None:
        try:
            self._engine = build()
        except BaseException as e:
            self._stopped.set()
            built.set_exception(e)
            return
        self._publish_stats()
        built.set_result(self._engine)
        try:
            while self._take_commands(block=not self._engine.has_unfinished_requests()):
                if self._engine.has_unfinished_requests():
                    self._step()
                if self._kv_sink is not None and (events := self._engine.take_kv_events()):
                    self._kv_sink(events)
                self._publish_stats()
        except BaseException:  # pragma: no cover - a bug in this loop; fail loudly but cleanly
            log.exception("the engine loop crashed")
        finally:
            self._engine.close()  # a parallel replica's other ranks stop with it
            self._stopped.set()
            for request_id, sink in self._sinks.items():
                sink.put(RequestFailedError(request_id, "the engine stopped"))
            self._sinks.clear()
            self._fail_queued_adds()

    def _take_commands(self, block: bool) -> bool:
        """Apply every queued command (waiting for one if `block`); False once asked to stop."""
        added = 0
        keep_running = True
        try:
            cmd = self._commands.get() if block else self._commands.get_nowait()
            while True:
                if isinstance(cmd, _Stop):
                    keep_running = False
                    break
                if isinstance(cmd, _Add):
                    added += 1
                    self._add(cmd)
                elif isinstance(cmd, _EnableKVEvents):
                    self._kv_sink = cmd.sink
                    cmd.done.set_result(self._engine.enable_kv_events())
                elif isinstance(cmd, _HeldKV):
                    self._held_kv(cmd)
                elif isinstance(cmd, _Call):
                    self._call(cmd)
                else:
                    self._abort(cmd.request_id)
                cmd = self._commands.get_nowait()
        except queue.Empty:
            pass
        if added:
            # Publish before un-counting them as pending, so admission control never misses them.
            self._publish_stats()
            with self._pending_lock:
                self._pending -= added
        return keep_running

    def _call(self, cmd: _Call) -> None:
        if not cmd.done.set_running_or_notify_cancel():
            return
        try:
            cmd.done.set_result(cmd.fn(self._engine))
        except Exception as e:  # typed errors travel back as they are; the engine goes on
            cmd.done.set_exception(e)

    def _add(self, cmd: _Add) -> None:
        if not cmd.done.set_running_or_notify_cancel():
            if cmd.received is not None:
                cmd.received.finish(None)
            return  # the caller gave up before we got here
        if cmd.received is not None:
            self._adopt(cmd.request_id, cmd.received)
        try:
            self._engine.add_request(cmd.prompt, cmd.params, cmd.request_id, hold_kv=cmd.hold_kv, lora=cmd.lora,
                                     soft_tokens=cmd.soft_tokens)
        except Exception as e:  # typed validation errors travel back as they are
            cmd.done.set_exception(e)
            return
        self._sinks[cmd.request_id] = cmd.sink
        cmd.done.set_result(None)

    def _adopt(self, request_id: str, kv: ReceivedKV) -> None:
        problem = None
        try:
            self._engine.adopt_kv(kv.token_ids, kv.block_hashes, kv.tensors, kv.valid_until)
        except Exception as e:  # the request recomputes what it cannot hit; it must not fail for this
            problem = f"adopting failed: {e}"
            log.exception("%s: adopting received KV failed; prefilling locally", request_id)
        finally:
            kv.finish(problem)

    def _held_kv(self, cmd: _HeldKV) -> None:
        if cmd.release:
            self._engine.release_kv(cmd.request_id)
        elif cmd.done is not None and cmd.done.set_running_or_notify_cancel():
            cmd.done.set_result(self._engine.held.get(cmd.request_id))

    def _abort(self, request_id: str) -> None:
        try:
            self._engine.abort_request(request_id)
        except Exception:
            log.exception("aborting %s failed", request_id)
            sink = self._sinks.pop(request_id, None)
            if sink is not None:
                sink.put(RequestFailedError(request_id, "the request could not be aborted cleanly"))

    def _step(self) -> None:
        try:
            outputs = self._engine.step()
        except Exception:
            # LLMEngine contains failures of the model itself; this is anything else (batch preparation,
            # detokenization). Fail every open request rather than retrying a step that keeps failing.
            log.exception("engine step failed; failing %d open requests", len(self._sinks))
            for request_id, sink in list(self._sinks.items()):
                sink.put(RequestFailedError(request_id, "the engine step failed"))
                self._abort_quietly(request_id)
            self._sinks.clear()
            return
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue  # e.g. the abort output of a request whose sink already got an error
            if out.finished:
                del self._sinks[out.request_id]
            sink.put(out)

    def _abort_quietly(self, request_id: str) -> None:
        try:
            self._engine.abort_request(request_id)
        except Exception:
            log.exception("aborting %s after a failed step failed too", request_id)

    def _fail_queued_adds(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Add) and cmd.done.set_running_or_notify_cancel():
                cmd.done.set_exception(EngineDeadError("the engine stopped"))

    def _publish_stats(self) -> None:
        eng = self._engine
        blocks = eng.blocks
        stats: dict[str, Any] = eng.stats
        self._stats = EngineStats(
            num_running=len(eng.scheduler.running),
            num_waiting=len(eng.scheduler.waiting),
            kv_cache_usage=blocks.usage,
            num_free_blocks=blocks.num_free_blocks,
            num_total_blocks=blocks.num_blocks,
            num_preemptions=eng.scheduler.num_preemptions,
            num_limited_chunks=eng.scheduler.num_limited_chunks,
            prefix_cache_queried_tokens=blocks.queried_tokens,
            prefix_cache_hit_tokens=blocks.hit_tokens,
            num_cached_blocks=blocks.num_cached_blocks,
            num_steps=stats["steps"],
            step_seconds=stats["step_seconds"],
            prompt_tokens=stats["prompt_tokens"],
            generation_tokens=stats["generation_tokens"],
            num_open_requests=len(self._sinks),
            num_held_kv=len(eng.held),
            num_aborted=stats["aborted"],
            rank_restarts=stats["rank_restarts"],
        )
        moes = [layer.moe for layer in eng.runner.model.layers if layer.moe is not None]
        if moes:
            tokens, imbalance = routing_stats(moes)
            placement = getattr(eng.runner.model, "expert_placement", None)
            self._stats = dataclasses.replace(self._stats, moe_expert_tokens=tokens, moe_imbalance=imbalance,
                                              moe_rank_tokens=rank_loads(tokens, placement) if placement else ())
        if eng.offload is not None:
            decisions = eng.offload.decide.decisions
            self._stats = dataclasses.replace(self._stats, offload=eng.offload.snapshot(),
                                              block_size=eng.cfg.block_size, offload_loaded=decisions.loaded,
                                              offload_recomputed=decisions.recomputed,
                                              offload_saved_seconds=decisions.saved_seconds,
                                              offload_not_admitted=eng.offload.not_admitted,
                                              offload_credits=eng.offload.credits())
        if eng.spec is not None:
            spec = eng.spec.stats
            self._stats = dataclasses.replace(
                self._stats, spec_proposed_tokens=spec.proposed_tokens, spec_accepted_tokens=spec.accepted_tokens,
                spec_verify_steps=spec.verify_steps, spec_emitted_tokens=spec.emitted_tokens,
                spec_drafter_seconds=spec.drafter_seconds)
