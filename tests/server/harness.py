"""A real uvicorn server on a loopback port, in a background thread, for tests."""

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn

from kvyard.server.app import build_app
from kvyard.server.async_engine import AsyncEngine
from kvyard.server.config import ServerSettings
from kvyard.server.context import ServerContext
from kvyard.server.lifecycle import KvyardServer


class RunningServer:
    def __init__(self, server: KvyardServer, ctx: ServerContext):
        self.server = server
        self.ctx = ctx
        port = server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"


@contextmanager
def running_server(engine: AsyncEngine, **settings: object) -> Iterator[RunningServer]:
    """Serve `build_app(engine, ServerSettings(**settings))` on 127.0.0.1 and an ephemeral port."""
    app = build_app(engine, ServerSettings(port=0, log_level="warning", **settings))  # type: ignore[arg-type]
    ctx: ServerContext = app.state.ctx
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off",
                            timeout_graceful_shutdown=2)
    server = KvyardServer(config, ctx)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    try:
        yield RunningServer(server, ctx)
    finally:
        server.should_exit = True
        thread.join(10)
        ctx.tokenizer.close()
        ctx.disagg.close()


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
