"""Small network helpers shared by the subsystems that start servers or process groups."""

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (the caller binds it soon after)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
