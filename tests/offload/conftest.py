import shutil
import socket
import subprocess
import time

import pytest
import redis


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A redis-server of its own on 127.0.0.1, without persistence, with a memory budget and LRU eviction."""

    def __init__(self, workdir, maxmemory: str = "64mb"):
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--maxmemory", maxmemory, "--maxmemory-policy", "allkeys-lru", "--dir", str(workdir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url, socket_timeout=1)
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                break
            except redis.RedisError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


@pytest.fixture
def redis_server(tmp_path):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (.ci/run installs it from Debian's packages)")
    server = RedisServer(tmp_path)
    yield server
    server.stop()
