"""The workers: registration with the hash handshake, periodic health checks, and their event subscribers.

A worker is routed to only while HEALTHY. It becomes DEAD after `dead_after` failed health checks in a
row, or at once when the proxy cannot connect to it; then its prefix-index entries and predictions are
dropped and its in-flight requests are told (`Worker.dead`). The health checker keeps polling dead and
pending workers; one that answers is handshaken again (a restarted worker may have changed) and
re-admitted, and its index is rebuilt from its snapshot.
"""

import asyncio
import logging
import time

import httpx
import msgspec
from prometheus_client.parser import text_string_to_metric_families

from kvyard.router.config import RouterSettings
from kvyard.router.handshake import HandshakeError, check_config, fetch_kv_config
from kvyard.router.kv_subscriber import KVEventSubscriber, reachable_endpoint
from kvyard.router.metrics import RouterMetrics
from kvyard.router.predicted import PredictedCache
from kvyard.router.prefix_index import PrefixIndex
from kvyard.router.worker import Worker, WorkerStatus
from kvyard.server.kv_config import KVConfig, local_kv_config

log = logging.getLogger(__name__)

# Worker gauges the health checker samples from /metrics.
_SAMPLES = {
    "kvyard_num_requests_running": "running",
    "kvyard_num_requests_waiting": "waiting",
    "kvyard_prefix_cache_queries_total": "prefix_queries",
    "kvyard_prefix_cache_hits_total": "prefix_hits",
    "kvyard_kv_cache_usage_ratio": "kv_usage",
}
# Labelled worker counters the health checker sums over their labels.
_SUMMED = {"kvyard_repetition_guard_trips_total": "repetition_trips"}


class InvalidWorkerURL(ValueError):
    """A worker address that cannot be one: not http(s)://host:port."""


def normalize_worker_url(url: str) -> str:
    """`url` as the registry keys it (no trailing slash or /v1); InvalidWorkerURL when it is malformed."""
    url = url.strip().rstrip("/").removesuffix("/v1")
    try:
        parts = httpx.URL(url)
        port = parts.port
    except (httpx.InvalidURL, ValueError, TypeError):
        raise InvalidWorkerURL(f"{url!r} is not a worker URL (expected http://host:port)") from None
    if (parts.scheme not in ("http", "https") or not parts.host or parts.path not in ("", "/") or parts.query
            or (port is not None and not 0 < port < 65536)):
        raise InvalidWorkerURL(f"{url!r} is not a worker URL (expected http://host:port)")
    return url


class WorkerRegistry:
    def __init__(
        self,
        settings: RouterSettings,
        tokenizer: object,
        index: PrefixIndex,
        predicted: PredictedCache,
        client: httpx.AsyncClient,
    ):
        self.s = settings
        self.index = index
        self.predicted = predicted
        self.client = client
        self.workers: dict[str, Worker] = {}
        self.subscribers: dict[str, KVEventSubscriber] = {}
        self.metrics = RouterMetrics(lambda: list(self.workers.values()))
        self.block_size = settings.block_size
        self.model: str | None = None  # the served model name every worker must share
        # The router's own scheme; its block size is filled in from the first worker when not configured.
        self._local = local_kv_config("", settings.block_size or 0, tokenizer)
        self._health_task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()  # keeps fire-and-forget tasks referenced

    # ---- registration --------------------------------------------------------------------------------

    def expected(self) -> KVConfig | None:
        return None if self.block_size is None else self._with_block_size(self.block_size)

    def _with_block_size(self, block_size: int) -> KVConfig:
        return msgspec.structs.replace(self._local, block_size=block_size)

    async def add(self, url: str) -> Worker:
        """Handshake with a worker and route to it. Raises InvalidWorkerURL (nothing is added),
        HandshakeError (it is then REFUSED) or an httpx error when it does not answer (it stays PENDING with
        that error shown in /workers; the health checker retries)."""
        url = normalize_worker_url(url)
        w = self.workers.setdefault(url, Worker(url))
        try:
            await self._handshake(w)
        except httpx.HTTPError as e:
            if w.status is not WorkerStatus.HEALTHY:
                w.error = f"unreachable: {type(e).__name__}: {e}"
            raise
        return w

    async def _handshake(self, w: Worker) -> None:
        try:
            got = await fetch_kv_config(self.client, w.url, self.s.health_timeout)
            check_config(w.url, self._with_block_size(self.block_size or got.block_size), got, self.model)
        except HandshakeError as e:
            if w.error != str(e):  # once per reason, not at every re-check
                log.error("%s", e)
            w.status, w.error = WorkerStatus.REFUSED, str(e)
            raise
        self.block_size = self.block_size or got.block_size
        self.model = self.model or got.model
        w.config = got
        self._follow_events(w)
        self._revive(w)
        log.info(
            "worker %s admitted (model %s, block size %d, events %s)",
            w.url,
            got.model,
            got.block_size,
            got.events_endpoint or "off",
        )

    def _follow_events(self, w: Worker) -> None:
        endpoint = w.config.events_endpoint if w.config else None
        wanted = reachable_endpoint(endpoint, w.url) if endpoint else None
        sub = self.subscribers.get(w.url)
        if sub is not None and sub.endpoint != wanted:  # a restarted worker may publish on another port
            self._background.add(asyncio.create_task(sub.stop()))
            del self.subscribers[w.url]
            sub = None
        if sub is None and endpoint is not None:
            sub = KVEventSubscriber(
                w.url,
                endpoint,
                self.index,
                self.client,
                on_resync=lambda reason, u=w.url: self.metrics.resyncs.labels(u, reason).inc(),
                on_events=lambda n, u=w.url: self.metrics.events.labels(u).inc(n),
                token=self.s.cluster_token,
            )
            self.subscribers[w.url] = sub
            sub.start()
        elif sub is not None:
            sub.invalidate()  # it may have missed events while the worker was away

    async def register_all(self) -> None:
        """Admit the configured workers, waiting up to `register_timeout` for each to come up.

        A refused worker is logged as an error and left out; the router serves with the others.
        """
        await asyncio.gather(*(self._register_with_retry(u) for u in self.s.workers))

    async def _register_with_retry(self, url: str) -> None:
        deadline = time.monotonic() + self.s.register_timeout
        while True:
            try:
                await self.add(url)
                return
            except HandshakeError:
                return  # logged loudly by check_config; the worker is REFUSED
            except httpx.HTTPError as e:
                if time.monotonic() > deadline:
                    log.error(
                        "worker %s did not answer the handshake within %.0f s: %s",
                        url,
                        self.s.register_timeout,
                        e,
                    )
                    return  # stays PENDING; the health checker keeps trying
                await asyncio.sleep(0.25)

    # ---- health --------------------------------------------------------------------------------------

    def routable(self) -> list[Worker]:
        return [w for w in self.workers.values() if w.routable]

    def start(self) -> None:
        self._health_task = asyncio.create_task(self._health_loop(), name="kvyard-router-health")

    async def stop(self) -> None:
        tasks = [t for t in [self._health_task] if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(s.stop() for s in self.subscribers.values()), return_exceptions=True)

    async def _health_loop(self) -> None:
        while True:
            checks = [
                self.check(w) for w in list(self.workers.values()) if w.status is not WorkerStatus.REFUSED
            ]
            await asyncio.gather(*checks, return_exceptions=True)
            await asyncio.sleep(self.s.health_interval)

    async def check(self, w: Worker) -> None:
        try:
            r = await self.client.get(w.url + "/health", timeout=self.s.health_timeout)
            ok = r.status_code == 200
            reason = f"/health answered {r.status_code}"
        except httpx.HTTPError as e:
            ok, reason = False, f"{type(e).__name__}: {e}"
        if not ok:
            w.failures += 1
            if w.status is WorkerStatus.HEALTHY and w.failures >= self.s.dead_after:
                self.mark_dead(w, reason)
            elif w.status is WorkerStatus.PENDING:
                w.error = f"unreachable: {reason}"
            return
        w.failures = 0
        if w.status is not WorkerStatus.HEALTHY:
            try:
                await self._handshake(w)
            except HandshakeError:
                return  # REFUSED, with its reason
            except httpx.HTTPError as e:
                w.error = f"handshake failed: {type(e).__name__}: {e}"
                return
        await self._sample_metrics(w)
        await self._refresh_adapters(w)

    async def _refresh_adapters(self, w: Worker) -> None:
        """The LoRA adapters the worker serves now (they load and unload at run time), from its /kv/config."""
        if w.config is None:
            return
        try:
            got = await fetch_kv_config(self.client, w.url, self.s.health_timeout)
        except (HandshakeError, httpx.HTTPError):
            return  # the next check tries again; until then the last list stands
        if got.lora_adapters != w.config.lora_adapters:
            w.config = msgspec.structs.replace(w.config, lora_adapters=got.lora_adapters)

    def adapter_digest(self, name: object) -> str | None:
        """The content digest of the LoRA adapter `name` as a routable worker serves it; None if none does."""
        if not isinstance(name, str):
            return None
        return next((w.config.lora_adapters[name] for w in self.routable() if w.serves_adapter(name)), None)

    async def _sample_metrics(self, w: Worker) -> None:
        try:
            r = await self.client.get(w.url + "/metrics", timeout=self.s.health_timeout)
            if r.status_code != 200:
                return
            sums = dict.fromkeys(_SUMMED.values(), 0.0)
            for family in text_string_to_metric_families(r.text):
                for sample in family.samples:
                    attr = _SAMPLES.get(sample.name)
                    if attr is not None:
                        setattr(w, attr, sample.value)
                    elif sample.name in _SUMMED:
                        sums[_SUMMED[sample.name]] += sample.value
            for attr, value in sums.items():
                setattr(w, attr, value)
        except (httpx.HTTPError, ValueError):
            pass  # a stats hiccup is not a health failure

    def mark_dead(self, w: Worker, reason: str) -> None:
        if w.status is WorkerStatus.DEAD:
            return
        log.warning("worker %s is out of the rotation: %s", w.url, reason)
        w.status, w.error = WorkerStatus.DEAD, reason
        w.dead.set()
        self.index.drop(w.url)
        self.predicted.drop(w.url)
        sub = self.subscribers.get(w.url)
        if sub is not None:
            sub.invalidate()

    def forget(self, url: str) -> None:
        """Remove a worker for good (a replica the Ray controller replaced): no checks, no subscriber."""
        self.workers.pop(url, None)
        sub = self.subscribers.pop(url, None)
        if sub is not None:
            self._background.add(asyncio.create_task(sub.stop()))

    def _revive(self, w: Worker) -> None:
        if w.status is not WorkerStatus.HEALTHY:
            w.status, w.error, w.failures = WorkerStatus.HEALTHY, None, 0
            w.dead = asyncio.Event()
