"""The router's FastAPI app: OpenAI-compatible routes proxied to workers, plus health, metrics and workers.

POST /v1/completions, /v1/chat/completions   placed by the policy, proxied (streaming or not)
GET  /v1/models                              from a live worker
GET  /health                                 200 while at least one worker is routable
GET  /metrics                                the router's Prometheus metrics
GET  /shadow                                 with a shadow candidate: the latest pairs' verdict (kvyard/shadow)
POST /shadow {shadow settings}, DELETE /shadow  mirror to a new candidate from now on, or stop mirroring
GET  /workers, POST /workers {"url": ...}     the registry; a worker on another machine joins by URL
"""

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from kvyard import __version__
from kvyard.config import section_setting
from kvyard.router.config import RouterSettings
from kvyard.router.dashboard import add_dashboard_routes
from kvyard.router.disagg import RemotePrefill
from kvyard.router.handshake import HandshakeError
from kvyard.router.placement import Placement, route_request
from kvyard.router.policies import LeastLoaded, make_policy
from kvyard.router.predicted import PredictedCache
from kvyard.router.prefix_index import PrefixIndex
from kvyard.router.prompts import PromptTokenizer
from kvyard.router.proxy import Proxy, error_body, forwarded_headers
from kvyard.router.registry import InvalidWorkerURL, WorkerRegistry, normalize_worker_url
from kvyard.server.guards import ApiKeyMiddleware
from kvyard.shadow.live import Shadow
from kvyard.shadow.mirror import ShadowSettings

log = logging.getLogger(__name__)


@dataclass
class RouterState:
    settings: RouterSettings
    client: httpx.AsyncClient
    registry: WorkerRegistry
    placement: Placement
    proxy: Proxy
    prompts: PromptTokenizer
    registering: "asyncio.Task[None]"
    remote_prefill: RemotePrefill
    by_load: LeastLoaded
    shadow: Shadow | None = None  # settings.shadow: a share of the requests to a candidate too, compared

    @classmethod
    def start(cls, settings: RouterSettings, tokenizer: Any) -> "RouterState":
        # No proxy settings from the environment, no pool limit (one connection per request in flight),
        # a short connect timeout (a dead worker should fail fast) and a long read one (long generations).
        client = httpx.AsyncClient(
            timeout=httpx.Timeout(settings.request_timeout, connect=2.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
            trust_env=False,
            headers=settings.worker_headers(),
        )
        index, predicted = PrefixIndex(), PredictedCache(settings.predicted_ttl)
        registry = WorkerRegistry(settings, tokenizer, index, predicted, client)
        placement = Placement(registry, index, predicted, make_policy(settings))
        proxy = Proxy(placement, registry, client, settings.max_attempts)
        registering = asyncio.create_task(registry.register_all())
        registry.start()
        remote = RemotePrefill(settings, registry, placement, client)
        prompts = PromptTokenizer(tokenizer)
        state = cls(settings, client, registry, placement, proxy, prompts, registering, remote, LeastLoaded())
        if isinstance(settings.shadow, ShadowSettings):
            state.shadow = state.new_shadow(settings.shadow)
        return state

    def new_shadow(self, settings: ShadowSettings) -> Shadow:
        reg = self.registry
        return Shadow(settings, self.client, self.prompts, reg.metrics.registry, reg.metrics.shadow,
                      lambda url: reg.workers[url].in_flight if url in reg.workers else 0)

    async def replace_shadow(self, settings: ShadowSettings | None) -> bool:
        """Mirror to a new candidate from now on (None: to none); the old one's pairs in flight are dropped.
        Returns whether there was one."""
        old, self.shadow = self.shadow, (self.new_shadow(settings) if settings is not None else None)
        if old is not None:
            await old.close()
        return old is not None

    async def stop(self) -> None:
        if self.shadow is not None:
            await self.shadow.close()
        self.registering.cancel()
        await self.registry.stop()
        await self.client.aclose()
        self.prompts.close()


def build_router_app(settings: RouterSettings, tokenizer: Any, controller: Any = None) -> FastAPI:
    """`controller`, when given (kvyard/cluster/controller.py), watches the replicas it placed and tells the
    registry when one dies or is replaced."""

    if controller is not None and settings.cluster_token is None:
        settings.cluster_token = controller.token  # the token the controller gave its replicas

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.router = RouterState.start(settings, tokenizer)
        if controller is not None:
            await controller.watch(app.state.router.registry, app.state.router.proxy.observed)
        try:
            yield
        finally:
            if controller is not None:
                await controller.close()
            await app.state.router.stop()

    app = FastAPI(
        title="kvyard router", version=__version__, docs_url=None, redoc_url=None, lifespan=lifespan
    )
    if settings.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key)
    add_dashboard_routes(app, lambda: app.state.router)

    def state() -> RouterState:
        return app.state.router

    async def generate(request: Request, path: str) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return JSONResponse(
                error_body(400, "the body must be a JSON object", "invalid_json"), status_code=400
            )
        st = state()
        block_size = st.registry.block_size
        tokens = await st.prompts.token_ids(path, body) if block_size else None
        # A LoRA adapter's request goes to a worker serving it, hashed with the adapter's salt; one no worker
        # serves goes anywhere, for the worker to answer that the model does not exist
        digest = st.registry.adapter_digest(body.get("model"))
        req = route_request(tokens, block_size or 1, bytes.fromhex(digest) if digest else b"",
                            body["model"] if digest else None)
        pair = st.shadow.offer(path, body, tokens) if st.shadow is not None else None
        watch = pair.reader("primary") if pair is not None else None
        policy = None
        kv_params = await st.remote_prefill.prefill(req, tokens)
        if kv_params is not None:
            # The decode worker will hold the whole prompt once the KV arrives: only its load matters.
            body["kv_transfer_params"] = kv_params
            raw, policy = json.dumps(body).encode(), st.by_load
        return await st.proxy.forward(path, raw, body.get("stream") is True, req, dict(request.headers), policy,
                                      watch)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        st = state()
        for w in st.placement.live():
            try:
                r = await st.client.get(
                    w.url + "/v1/models",
                    timeout=settings.health_timeout,
                    headers=forwarded_headers(dict(request.headers), st.client),
                )
            except httpx.HTTPError:
                continue
            return Response(r.content, status_code=r.status_code, media_type="application/json")
        return JSONResponse(error_body(503, "no worker is healthy", "no_worker_available"), status_code=503)

    @app.get("/health")
    async def health() -> JSONResponse:
        live = len(state().registry.routable())
        return JSONResponse(
            {"status": "ok" if live else "no healthy worker", "healthy_workers": live},
            status_code=200 if live else 503,
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = state().registry.metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/shadow")
    async def shadow() -> JSONResponse:
        st = state()
        if st.shadow is None:
            return JSONResponse(error_body(404, "this router has no shadow candidate", "no_shadow"), 404)
        return JSONResponse(st.shadow.verdict())

    @app.post("/shadow")
    async def set_shadow(request: Request) -> JSONResponse:
        try:
            body = await request.json()
            if not isinstance(body, dict | str):
                raise ValueError("expected a JSON object of shadow settings, or a URL")
            candidate = section_setting(ShadowSettings, body, "shadow", shorthand="url")
        except (ValueError, TypeError) as e:  # ConfigError is a ValueError; a missing url is a TypeError
            return JSONResponse(error_body(400, f"shadow settings: {e}", "invalid_shadow"), 400)
        replaced = await state().replace_shadow(candidate)
        return JSONResponse({"url": candidate.url, "candidate_model": candidate.candidate_model,
                             "replaced": replaced})

    @app.delete("/shadow")
    async def stop_shadow() -> JSONResponse:
        return JSONResponse({"stopped": await state().replace_shadow(None)})

    @app.get("/workers")
    async def workers() -> JSONResponse:
        reg = state().registry
        return JSONResponse(
            {
                "policy": settings.policy,
                "block_size": reg.block_size,
                "model": reg.model,
                "workers": [{**w.describe(), "cached_blocks": reg.index.num_blocks(w.url),
                             "tier_blocks": reg.index.tiers.num_blocks(w.url),
                             "tier_credits": reg.index.tiers.credits(w.url)} for w in reg.workers.values()],
            }
        )

    @app.post("/workers")
    async def add_worker(request: Request) -> JSONResponse:
        try:
            url = (await request.json())["url"]
            assert isinstance(url, str)
        except (ValueError, KeyError, TypeError, AssertionError):
            return JSONResponse(
                error_body(400, 'expected {"url": "http://host:port"}', "invalid_request"), 400
            )
        try:
            w = await state().registry.add(url)
        except InvalidWorkerURL as e:
            return JSONResponse(error_body(400, str(e), "invalid_worker_url"), status_code=400)
        except HandshakeError as e:
            return JSONResponse(error_body(409, str(e), "kv_config_mismatch"), status_code=409)
        except httpx.HTTPError as e:
            return JSONResponse(error_body(502, f"{url} did not answer: {e}", "worker_unreachable"), 502)
        return JSONResponse(w.describe())

    @app.delete("/workers")
    @app.delete("/workers/{url:path}")
    async def remove_worker(url: str) -> JSONResponse:
        """`DELETE /workers/http://host:port` (or `?url=`): stop routing to it and forget it, whatever its state."""
        reg = state().registry
        try:
            key = normalize_worker_url(url)
        except InvalidWorkerURL as e:
            return JSONResponse(error_body(400, str(e), "invalid_worker_url"), status_code=400)
        if key not in reg.workers:
            return JSONResponse(error_body(404, f"no worker {url}", "worker_not_found"), status_code=404)
        reg.forget(key)
        log.info("worker %s removed", key)
        return JSONResponse({"removed": key})

    return app
