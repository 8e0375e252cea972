"""Running the server under uvicorn, and draining it on SIGTERM.

Drain: the first SIGTERM (or Ctrl-C) marks the app as draining. From then on the guard middleware
answers every new request with 503 (and /health with 503, so a load balancer stops routing here),
while requests already in flight run to completion. When none are left, or after `drain_timeout`
seconds (then the stragglers are interrupted: their engine requests are aborted and their streams end
with an error event), uvicorn is told to exit and the process exits 0. A second signal exits at once.
"""

import asyncio
import logging
import signal
import time
from types import FrameType

import uvicorn

from kvyard.config import EngineConfig
from kvyard.server.app import build_app
from kvyard.server.async_engine import AsyncEngine
from kvyard.server.config import ServerSettings
from kvyard.server.context import ServerContext
from kvyard.server.errors import APIError

log = logging.getLogger(__name__)

# After the drain, how long uvicorn waits for connections to close before cancelling their tasks.
_CLOSE_GRACE_S = 5.0


class KvyardServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, ctx: ServerContext):
        super().__init__(config)
        self.ctx = ctx
        self._drain_task: asyncio.Task[None] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Runs in the signal handler: only set flags here; on_tick starts the drain on the loop.
        # Unlike uvicorn's own handler it does not record the signal, which uvicorn would re-raise
        # after shutting down and so turn a clean drain into death by SIGTERM.
        if self.ctx.drain.draining:
            self.should_exit = True
            self.force_exit = sig == signal.SIGINT
            return
        self.ctx.drain.draining = True

    def begin_drain(self) -> None:
        """The same as receiving SIGTERM (for embedding and tests)."""
        self.ctx.drain.draining = True

    async def on_tick(self, counter: int) -> bool:
        if self.ctx.drain.draining and self._drain_task is None:
            self._drain_task = asyncio.create_task(self._drain())
        return await super().on_tick(counter)

    async def _drain(self) -> None:
        drain = self.ctx.drain
        timeout = self.ctx.settings.drain_timeout
        log.info("draining: %d requests in flight, up to %.0f s", drain.in_flight, timeout)
        deadline = time.monotonic() + timeout
        while drain.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if drain.in_flight > 0:
            log.warning("drain timeout: interrupting %d requests", drain.in_flight)
            for run in list(drain.runs):
                run.interrupt(APIError(503, "the server shut down before the request finished",
                                       code="server_shutdown"))
            grace = time.monotonic() + _CLOSE_GRACE_S
            while drain.in_flight > 0 and time.monotonic() < grace:
                await asyncio.sleep(0.05)
        log.info("drained; shutting down")
        self.should_exit = True


def serve(engine_config: EngineConfig, settings: ServerSettings) -> None:
    """Build the engine and the app, serve until drained, then stop the engine."""
    engine = AsyncEngine.from_config(engine_config)
    try:
        app = build_app(engine, settings)
        ctx: ServerContext = app.state.ctx
        config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                                timeout_graceful_shutdown=_CLOSE_GRACE_S, lifespan="off")
        try:
            KvyardServer(config, ctx).run()
        finally:
            ctx.tokenizer.close()
            ctx.disagg.close()
            if ctx.capture is not None:
                ctx.capture.close()  # what is queued is written first
            if app.state.kv_events is not None:
                app.state.kv_events.close()
    finally:
        engine.shutdown()
