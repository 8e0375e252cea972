"""Prefill/decode disaggregation on one worker: both halves of a KV handoff, and their metrics.

Prefill side (`--role prefill`, or `both` with `--kv-transfer-port`): `POST /kv/prefill` runs a prompt as
a one-token request that keeps its KV (`hold_kv`), offers the full blocks on the worker's KV source
(kvyard/disagg/), and answers with the `kv_transfer_params` a decode worker needs to pull them. The
blocks stay referenced until the decode worker acknowledges the pull or `kv_hold_timeout` passes.

Decode side (`decode` or `both`): a completion or chat request that carries `kv_transfer_params` has its
prompt's KV pulled, completely checked, and adopted into the prefix cache just before the request joins
the engine; the request then hits those blocks and computes only the last prompt token (whose logits it
samples from, so seeds, logprobs and grammars behave exactly as without disaggregation). Any failure (the
prefill worker died, the pull timed out, the payload is corrupt or for other tokens) falls back to local
prefill and is counted; the request itself never fails for it.
"""

import asyncio
import logging
import socket
import time

from prometheus_client import CollectorRegistry, Counter, Histogram

from kvyard.engine.block_manager import block_hashes
from kvyard.engine.kv_cache import KVGroups
from kvyard.errors import ConfigError, InvalidRequestError
from kvyard.sampling_params import SamplingParams
from kvyard.server.async_engine import AsyncEngine, ReceivedKV, RequestFailedError
from kvyard.server.config import ServerSettings
from kvyard.server.protocol import KVTransferParams, OpenAIModel, TokenId

log = logging.getLogger(__name__)

_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class PrefillRequest(OpenAIModel):
    """The body of POST /kv/prefill: the prompt as the router tokenized it (the same ids a decode worker gets)."""

    prompt_token_ids: list[TokenId]


class DisaggMetrics:
    def __init__(self, registry: CollectorRegistry):
        r = registry
        self.prefills = Counter("kvyard_kv_prefills", "Prompts prefilled for a decode worker, by outcome "
                                "(offered, no_blocks: too short to hand over, failed)", ["outcome"], registry=r)
        self.pulls = Counter("kvyard_kv_pulls", "KV pulls of a decode worker, by outcome: ok, or the reason it "
                             "prefilled locally instead (transfer_failed, integrity, prompt_mismatch, error)",
                             ["outcome"], registry=r)
        self.pulled_bytes = Counter("kvyard_kv_pulled_bytes", "Bytes of KV received from prefill workers",
                                    registry=r)
        self.pull_seconds = Histogram("kvyard_kv_pull_seconds", "Time of one successful KV pull",
                                      buckets=_SECONDS_BUCKETS, registry=r)


def require_one_pool(engine: AsyncEngine) -> None:
    """KV moves between workers block by block of one pool: sliding-window pools give blocks back and keep a
    second table (kvyard/engine/window_blocks.py), which the transfer does not carry yet."""
    if engine.kv_groups != KVGroups():
        raise ConfigError(f"{engine.model_name}: prefill/decode disaggregation does not move sliding-window KV "
                          "pools yet; serve this model colocated")


class PrefillService:
    """The prefill side: computes a prompt's KV, holds it and offers it to decode workers."""

    def __init__(self, engine: AsyncEngine, settings: ServerSettings, metrics: DisaggMetrics):
        from kvyard.disagg.zmq_transport import KVSource

        require_one_pool(engine)
        self.engine = engine
        self.settings = settings
        self.metrics = metrics
        port = settings.kv_transfer_port or 0
        host = settings.host if settings.host not in ("0.0.0.0", "::") else socket.gethostname()
        self.source = KVSource(engine.kv_caches, engine.block_size, bind=f"tcp://{settings.host}:{port}",
                               advertise_host=host, mode=settings.kv_transfer_mode, token=settings.cluster_token)
        warm = self.source.warm_shm(-(-engine.max_model_len // engine.block_size))  # the longest prompt
        log.info("kv source at %s; shared-memory segment %s", self.source.endpoint,
                 "warmed" if warm else "not warmed (too large for the pool or /dev/shm)")

    async def prefill(self, request_id: str, token_ids: list[int]) -> dict[str, object]:
        """Run the prompt, then offer its KV; the answer is a decode worker's `kv_transfer_params`."""
        start = time.monotonic()
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        try:
            async for _ in self.engine.generate(token_ids, params, request_id, hold_kv=True):
                pass
        except RequestFailedError:
            self.metrics.prefills.labels("failed").inc()
            raise
        held = await self.engine.held_kv(request_id)
        bs = self.engine.block_size
        # A decode worker computes the last prompt token itself (it samples from its logits), so it can use
        # only the full blocks before that token.
        usable = min(len(held.block_ids) if held else 0, (len(token_ids) - 1) // bs)
        answer: dict[str, object] = {"transfer_id": request_id, "endpoint": self.source.endpoint,
                                     "num_blocks": usable}
        if held is None or usable == 0:
            if held is not None:
                self.engine.release_kv_nowait(request_id)
            self.metrics.prefills.labels("no_blocks").inc()
        else:
            try:
                self.source.offer(request_id, held.block_ids[:usable], held.block_hashes[:usable],
                                  held.token_ids[: usable * bs], lambda: self.engine.release_kv_nowait(request_id),
                                  self.settings.kv_hold_timeout)
            except BaseException:
                self.engine.release_kv_nowait(request_id)
                self.metrics.prefills.labels("failed").inc()
                raise
            self.metrics.prefills.labels("offered").inc()
        answer["prefill_seconds"] = time.monotonic() - start
        return answer

    def close(self) -> None:
        self.source.close()


class KVReceiver:
    """The decode side: pulls a request's prompt KV and hands it to the engine with the request."""

    def __init__(self, engine: AsyncEngine, settings: ServerSettings, metrics: DisaggMetrics):
        from kvyard.disagg.layout import KVLayout
        from kvyard.disagg.zmq_transport import KVFetcher

        require_one_pool(engine)
        self.block_size = engine.block_size
        self.layout = KVLayout.of(engine.kv_caches, engine.block_size)
        self.fetcher = KVFetcher(token=settings.cluster_token)
        self.timeout = settings.kv_fetch_timeout
        self.metrics = metrics

    async def receive(self, token_ids: list[int], params: KVTransferParams) -> ReceivedKV | None:
        """The pulled KV, or None (counted) when the request should prefill locally."""
        from kvyard.disagg.payload import KVIntegrityError, KVTransferError

        if params.num_blocks == 0:
            return None
        if params.num_blocks > (len(token_ids) - 1) // self.block_size:
            self.metrics.pulls.labels("prompt_mismatch").inc()  # the prefill worker saw another prompt
            log.warning("%s: KV for %d blocks does not fit this prompt of %d tokens; prefilling locally",
                        params.transfer_id, params.num_blocks, len(token_ids))
            return None
        expected = block_hashes(token_ids[: params.num_blocks * self.block_size], self.block_size)
        start = time.monotonic()
        try:
            # In place: a same-host pull hands the engine views of the source's segment; the engine copies
            # them into its cache and acknowledges (ReceivedKV.finish), one pass over the bytes fewer.
            payload = await asyncio.to_thread(self.fetcher.fetch, params.endpoint, params.transfer_id, self.layout,
                                              expected, self.timeout, True)
        except (KVTransferError, KVIntegrityError) as e:
            outcome = "integrity" if isinstance(e, KVIntegrityError) else "transfer_failed"
            self.metrics.pulls.labels(outcome).inc()
            log.warning("%s: KV pull failed (%s); prefilling locally", params.transfer_id, e)
            return None
        except Exception:  # noqa: BLE001 - whatever went wrong, the request still completes
            self.metrics.pulls.labels("error").inc()
            log.exception("%s: KV pull failed; prefilling locally", params.transfer_id)
            return None
        self.metrics.pulls.labels("ok").inc()
        self.metrics.pulled_bytes.inc(payload.nbytes)
        self.metrics.pull_seconds.observe(time.monotonic() - start)
        return ReceivedKV(payload.token_ids, payload.block_hashes, payload.tensors, payload.valid_until,
                          payload.finish)


class Disaggregation:
    """What one worker does for disaggregated serving, by its role."""

    def __init__(self, engine: AsyncEngine, settings: ServerSettings, registry: CollectorRegistry):
        self.role = settings.role
        self.metrics = DisaggMetrics(registry)
        self._engine = engine
        self._settings = settings
        serves_prefill = settings.role == "prefill" or settings.kv_transfer_port is not None
        self.prefill: PrefillService | None = (
            PrefillService(engine, settings, self.metrics) if serves_prefill and settings.role != "decode" else None
        )
        self._receiver: KVReceiver | None = None  # built on the first pull (most workers never pull)

    @property
    def endpoint(self) -> str | None:
        return self.prefill.source.endpoint if self.prefill else None

    async def receive(self, prompts: list[list[int]], params: KVTransferParams | None) -> ReceivedKV | None:
        if params is None:
            return None
        if self.role == "prefill":
            raise InvalidRequestError("this worker only prefills; send kv_transfer_params to a decode worker",
                                      param="kv_transfer_params")
        if len(prompts) != 1:
            raise InvalidRequestError("kv_transfer_params needs exactly one prompt", param="kv_transfer_params")
        if self._receiver is None:
            self._receiver = KVReceiver(self._engine, self._settings, self.metrics)
        return await self._receiver.receive(prompts[0], params)

    def close(self) -> None:
        if self.prefill is not None:
            self.prefill.close()
