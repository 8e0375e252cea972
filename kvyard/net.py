"""Small network helpers shared by the subsystems that start servers or process groups."""

import socket
from collections.abc import AsyncIterator

import httpx


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (the caller binds it soon after)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


async def sse_events(resp: httpx.Response) -> AsyncIterator[bytes]:
    """Complete server-sent events (up to and including their blank line), never half of one."""
    buf = b""
    async for chunk in resp.aiter_bytes():
        buf += chunk
        while (i := buf.find(b"\n\n")) >= 0:
            yield buf[: i + 2]
            buf = buf[i + 2 :]
