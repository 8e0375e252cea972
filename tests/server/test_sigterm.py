"""`kvyard serve` as a real process: SIGTERM lets the running stream finish, refuses new work, exits 0."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.tiny import make_tiny_checkpoint

ROOT = Path(__file__).parents[2]
MAX_TOKENS = 1000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def server_process(tmp_path):
    # A long context, so one request can outlast the signal by seconds.
    model = make_tiny_checkpoint(tmp_path / "long", max_position_embeddings=4096)
    port = free_port()
    # The random model loops, and the stream must give all its tokens: no repetition guard.
    cmd = [sys.executable, "-m", "kvyard.cli.main", "serve", "--model", str(model), "--dtype", "float32",
           "--kv-cache-memory", "4MiB", "--num-threads", "1", "--port", str(port), "--log-level", "warning",
           "--drain-timeout", "60", "--repetition-guard", "off"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "KVYARD_API_KEY": ""},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        assert proc.poll() is None, proc.communicate()[0]
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server did not come up"
        time.sleep(0.2)
    yield proc, url
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_sigterm_drains_in_flight_streams_then_exits_zero(server_process):
    proc, url = server_process
    lines: list[str] = []
    first = threading.Event()

    def stream() -> None:
        body = {"prompt": "The quick", "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line:  # blank lines separate events
                    lines.append(line)
                    first.set()

    t = threading.Thread(target=stream)
    t.start()
    assert first.wait(30)
    proc.send_signal(signal.SIGTERM)

    deadline = time.monotonic() + 5
    while True:  # the signal is handled between two bytecodes of the server's main thread: soon
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
        if r.status_code == 503:
            break
        assert r.status_code == 200 and time.monotonic() < deadline
        time.sleep(0.05)
    assert r.json()["error"]["code"] == "server_draining"
    assert len(lines) < MAX_TOKENS, "the stream finished before the drain was observed; make it longer"

    t.join(120)
    events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert lines[-1] == "data: [DONE]" and not any("error" in e for e in events)
    assert events[-1]["usage"]["completion_tokens"] == MAX_TOKENS
    assert proc.wait(30) == 0, proc.communicate()[0]
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health", timeout=2)
