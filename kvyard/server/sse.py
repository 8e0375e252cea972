"""Server-sent events, and noticing a client that hangs up, streaming or not.

Starlette's StreamingResponse watches for a disconnect only on old ASGI versions; on newer ones it
notices when a write fails, i.e. not while a request waits in the queue or prefills. Here a listener
task always waits for `http.disconnect` and cancels the work at once, which unwinds the generator that
feeds the response and aborts its engine requests (their `finally` blocks do that).
"""

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")

DONE = "data: [DONE]\n\n"


def sse(payload: Any) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


class ClientDisconnected(Exception):
    pass


async def wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class EventStreamResponse(StreamingResponse):
    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None] | None = None):
        # No proxy buffering, no caching: every event should reach the client when it is produced.
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self._serve(send, receive)
        finally:
            if self._on_close is not None:
                self._on_close()  # covers a stream cancelled before its generator ever ran

    async def _serve(self, send: Send, receive: Receive) -> None:
        async with anyio.create_task_group() as tg:

            async def stream() -> None:
                try:
                    await self.stream_response(send)
                except OSError:
                    pass  # the client went away mid-write; the listener sees the disconnect too
                tg.cancel_scope.cancel()

            tg.start_soon(stream)
            await wait_for_disconnect(receive)
            tg.cancel_scope.cancel()


async def run_until_disconnect(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """Await `work`, cancelling it if the client disconnects first (then raise ClientDisconnected)."""
    task = asyncio.ensure_future(work)
    listener = asyncio.ensure_future(wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientDisconnected()
    finally:
        for t in (task, listener):
            t.cancel()
        # Let the work unwind (its finally blocks abort engine requests) before we return.
        await asyncio.gather(task, listener, return_exceptions=True)
