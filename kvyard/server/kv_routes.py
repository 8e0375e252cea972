"""`GET /kv/config` (the hash-agreement handshake) and `GET /kv/snapshot` (resync after a gap) of a worker.

With `kv_events_port` set, the app also starts the KV event publisher (kvyard/server/kv_events.py); it
lives on `app.state.kv_events` and whoever runs the app closes it (`lifecycle.serve`).
"""

import uuid

import msgspec
from fastapi import FastAPI, Response

from kvyard.server.async_engine import AsyncEngine
from kvyard.server.config import ServerSettings
from kvyard.server.errors import APIError
from kvyard.server.kv_config import local_kv_config
from kvyard.server.kv_events import KVEventPublisher

_ATTACH_TIMEOUT_S = 30.0


def start_publisher(engine: AsyncEngine, settings: ServerSettings) -> KVEventPublisher | None:
    if settings.kv_events_port is None:
        return None
    publisher = KVEventPublisher(settings.host, settings.kv_events_port)
    try:
        publisher.start(engine.enable_kv_events(publisher.put).result(_ATTACH_TIMEOUT_S))
    except BaseException:
        publisher.close()
        raise
    return publisher


def install_kv_routes(app: FastAPI, engine: AsyncEngine, settings: ServerSettings, model_name: str) -> None:
    publisher = start_publisher(engine, settings)
    app.state.kv_events = publisher
    config = local_kv_config(
        model_name,
        engine.block_size,
        engine.tokenizer,
        enable_prefix_caching=engine.enable_prefix_caching,
        instance_id=publisher.instance_id if publisher else uuid.uuid4().hex,
        events_endpoint=publisher.endpoint if publisher else None,
    )
    body = msgspec.json.encode(config)

    @app.get("/kv/config")
    async def kv_config() -> Response:
        return Response(body, media_type="application/json")

    @app.get("/kv/snapshot")
    async def kv_snapshot() -> Response:
        if publisher is None:
            raise APIError(404, "this worker publishes no KV events (start it with --kv-events-port)")
        return Response(msgspec.json.encode(publisher.snapshot()), media_type="application/json")
