"""`GET /kv/config` (the hash-agreement handshake) and `GET /kv/snapshot` (resync after a gap) of a worker.

With `kv_events_port` set, the app also starts the KV event publisher (kvyard/server/kv_events.py); it
lives on `app.state.kv_events` and whoever runs the app closes it (`lifecycle.serve`).
"""

import uuid

import msgspec
from fastapi import FastAPI, Request, Response

from kvyard.server.async_engine import AsyncEngine
from kvyard.server.config import ServerSettings
from kvyard.server.disagg import Disaggregation, PrefillRequest
from kvyard.server.errors import APIError
from kvyard.server.kv_config import local_kv_config
from kvyard.server.kv_events import KVEventPublisher
from kvyard.server.protocol import read_body

_ATTACH_TIMEOUT_S = 30.0


def start_publisher(engine: AsyncEngine, settings: ServerSettings) -> KVEventPublisher | None:
    if settings.kv_events_port is None:
        return None
    publisher = KVEventPublisher(settings.host, settings.kv_events_port, token=settings.cluster_token)
    try:
        publisher.credits = engine.offload_credits
        publisher.start(engine.enable_kv_events(publisher.put).result(_ATTACH_TIMEOUT_S))
    except BaseException:
        publisher.close()
        raise
    return publisher


def install_kv_routes(app: FastAPI, engine: AsyncEngine, settings: ServerSettings, model_name: str,
                      disagg: Disaggregation) -> None:
    publisher = start_publisher(engine, settings)
    app.state.kv_events = publisher
    config = local_kv_config(
        model_name,
        engine.block_size,
        engine.tokenizer,
        enable_prefix_caching=engine.enable_prefix_caching,
        instance_id=publisher.instance_id if publisher else uuid.uuid4().hex,
        events_endpoint=publisher.endpoint if publisher else None,
        role=settings.role,
        kv_transfer_endpoint=disagg.endpoint,
    )

    @app.get("/kv/config")
    async def kv_config() -> Response:  # the adapters as they are now: they load and unload at run time
        digests = {name: served.digest for name, served in engine.lora_adapters.items()}
        body = msgspec.json.encode(msgspec.structs.replace(config, lora_adapters=digests))
        return Response(body, media_type="application/json")

    @app.post("/kv/prefill")
    async def kv_prefill(request: Request) -> Response:
        """Compute a prompt's KV for a decode worker; the answer is that worker's `kv_transfer_params`."""
        if disagg.prefill is None:
            raise APIError(404, f"this worker (role {settings.role}) does not prefill for others; "
                           "start it with --role prefill, or --kv-transfer-port with role both")
        body = await read_body(request, PrefillRequest)
        ids = list(body.prompt_token_ids)
        answer = await disagg.prefill.prefill(f"kvp-{uuid.uuid4().hex}", ids)
        return Response(msgspec.json.encode(answer), media_type="application/json")

    @app.get("/kv/snapshot")
    async def kv_snapshot() -> Response:
        if publisher is None:
            raise APIError(404, "this worker publishes no KV events (start it with --kv-events-port)")
        return Response(msgspec.json.encode(publisher.snapshot()), media_type="application/json")
