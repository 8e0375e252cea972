"""In-process workers (with KV events) and an in-process router, on loopback ports, for router tests."""

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

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
    def __init__(self, server: uvicorn.Server, app: object, api_key: str | None = None):
        self.server = server
        self.app = app
        self.headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        port = server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    @property
    def state(self):
        return self.app.state.router  # type: ignore[attr-defined]

    def workers(self) -> dict[str, dict]:
        data = httpx.get(self.url + "/workers", timeout=5, trust_env=False, headers=self.headers).json()
        return {w["url"]: w for w in data["workers"]}


@contextlib.contextmanager
def running_router(tokenizer: object, controller: object = None, **settings: object) -> Iterator[RunningRouter]:
    cfg = RouterSettings(**{"port": 0, "log_level": "warning", "health_interval": 0.2, **settings})  # type: ignore[arg-type]
    app = build_router_app(cfg, tokenizer, controller)
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
        yield RunningRouter(server, app, cfg.api_key)
    finally:
        server.should_exit = True
        thread.join(10)


@dataclass
class StreamedRun:
    """One streamed completion on a thread of its own: which worker served it and its `data:` lines (or a
    "client error: ..." line last when the connection broke)."""

    thread: threading.Thread
    started: threading.Event
    worker: str | None = None
    lines: list[str] = field(default_factory=list)


def start_streams(url: str, body: dict, n: int, first_event_timeout: float = 30.0) -> list[StreamedRun]:
    """`n` streamed completions of `body` at once, each on a new connection; returns once each has its first
    event (asserting that they all got one)."""

    def run(s: StreamedRun) -> None:
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60, trust_env=False) as r:
                s.worker = r.headers.get("x-kvyard-worker")
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        s.lines.append(line[5:].strip())
                        s.started.set()
        except httpx.HTTPError as e:
            s.lines.append(f"client error: {e}")
            s.started.set()

    runs = []
    for _ in range(n):
        s = StreamedRun(threading.Thread(), threading.Event())
        s.thread = threading.Thread(target=run, args=(s,), daemon=True)
        s.thread.start()
        runs.append(s)
    assert all(s.started.wait(first_event_timeout) for s in runs), "a stream got no first event"
    return runs


def errors_after_losing(runs: list[StreamedRun], lost: str, timeout: float = 60.0) -> list[dict]:
    """Wait for every stream after worker `lost` died: each must end with [DONE] (none hangs); those on the
    lost worker just after an error event, unless they had finished before it died (a finish reason), the
    others with none. Returns those error bodies."""
    errors = []
    for run in runs:
        run.thread.join(timeout)
        assert not run.thread.is_alive(), "a stream hung after its worker died"
        assert run.lines[-1] == "[DONE]", run.lines[-3:]
        last = json.loads(run.lines[-2])
        if run.worker == lost and "error" in last:
            errors.append(last["error"])
        else:
            assert "error" not in last and any(c.get("finish_reason") for c in last["choices"]), run.lines[-3:]
    return errors


def workers_serving_until(router_url: str, wanted: str, attempts: int = 30) -> set[str]:
    """Workers that served short completions, sent one by one until `wanted` serves one (or `attempts` run out).

    With no prefix to follow, the kv policy breaks cost ties at random, so a fixed handful of requests can miss an
    idle worker by luck; the loop is bounded, not the luck."""
    served: set[str] = set()
    for i in range(attempts):
        r = httpx.post(router_url + "/v1/completions", json={"prompt": f"Question {i}: why?", "max_tokens": 2},
                       timeout=30, trust_env=False)
        assert r.status_code == 200, r.text
        served.add(r.headers["x-kvyard-worker"])
        if wanted in served:
            break
    return served
