"""In-process workers (with KV events) and an in-process router, on loopback ports, for router tests."""

import contextlib
import threading
import time
from collections.abc import Iterator

import httpx
import uvicorn

from kvyard.router.app import build_router_app
from kvyard.router.config import RouterSettings
from kvyard.server.async_engine import AsyncEngine
from tests.server.harness import RunningServer, running_server


@contextlib.contextmanager
def running_worker(engine: AsyncEngine, **settings: object) -> Iterator[RunningServer]:
    """A kvyard server publishing KV events on a free port; the publisher is closed afterwards."""
    settings.setdefault("kv_events_port", 0)
    with running_server(engine, **settings) as srv:
        try:
            yield srv
        finally:
            publisher = srv.server.config.app.state.kv_events
            srv.server.should_exit = True
    if publisher is not None:
        publisher.close()


class RunningRouter:
    def __init__(self, server: uvicorn.Server, app: object):
        self.server = server
        self.app = app
        port = server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    @property
    def state(self):
        return self.app.state.router  # type: ignore[attr-defined]

    def workers(self) -> dict[str, dict]:
        data = httpx.get(self.url + "/workers", timeout=5, trust_env=False).json()
        return {w["url"]: w for w in data["workers"]}


@contextlib.contextmanager
def running_router(tokenizer: object, **settings: object) -> Iterator[RunningRouter]:
    cfg = RouterSettings(port=0, log_level="warning", health_interval=0.2, **settings)  # type: ignore[arg-type]
    app = build_router_app(cfg, tokenizer)
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test router did not start")
        time.sleep(0.01)
    try:
        yield RunningRouter(server, app)
    finally:
        server.should_exit = True
        thread.join(10)
