"""`kvyard up` end to end: two worker processes and the router, used through the `openai` client; cache
affinity; a worker killed mid-run (no hang, cut streams end with an error event, traffic moves on); and
SIGTERM stopping every process."""

import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from tests.router.harness import errors_after_losing, start_streams, workers_serving_until

SYSTEM = "You are a careful assistant. Paged attention keeps the KV cache in fixed-size blocks. " * 3


def free_port_run(n: int) -> int:
    """A port p such that p..p+n-1 are all free now, drawn below the OS's ephemeral range: a port from that
    range can be taken by any outgoing connection (the router's own health checks) before the worker that
    was given it binds it."""
    try:
        low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(10000, max(10001, low - n))
        socks = []
        try:
            for i in range(n):
                t = socket.socket()
                socks.append(t)
                t.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for t in socks:
                t.close()
    raise RuntimeError("no free port run")


def children(pid: int) -> list[int]:
    """Child processes of `pid`, whichever of its threads started them (the supervisor thread restarts workers)."""
    return [int(c) for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()]


class Cluster:
    def __init__(self, proc: subprocess.Popen, port: int):
        self.proc = proc
        self.url = f"http://127.0.0.1:{port}"
        self.worker_urls = [f"http://127.0.0.1:{port + 1}", f"http://127.0.0.1:{port + 2}"]

    def workers(self) -> dict[str, dict]:
        data = httpx.get(self.url + "/workers", timeout=5, trust_env=False).json()
        return {w["url"]: w for w in data["workers"]}

    def worker_pid(self, url: str) -> int:
        port = url.rsplit(":", 1)[1]
        for pid in children(self.proc.pid):
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"--port" in args and args[args.index(b"--port") + 1] == port.encode():
                return pid
        raise LookupError(url)


def wait(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if predicate():
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    return False


def start_up(tiny_path, logs: Path, replicas: int, *extra: str) -> tuple[subprocess.Popen, int]:
    """`kvyard up` with `replicas` tiny workers on a free run of ports; (process, router port)."""
    port = free_port_run(replicas + 1)
    cmd = [sys.executable, "-m", "kvyard.cli.main", "up", "--replicas", str(replicas), "--model", str(tiny_path),
           "--router-port", str(port), "--num-threads", "1", "--log-dir", str(logs), "--log-level", "warning",
           "--serve-args", "--dtype float32 --kv-cache-memory 2MiB --max-num-batched-tokens 256",
           "--health-interval", "0.3", "--predicted-ttl", "0.5", "--seed", "0", *extra]
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL), port


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)


@pytest.fixture(scope="module")
def cluster(tiny_path, tmp_path_factory):
    # A 3 s restart backoff: the killed worker stays dead long enough for the checks of its absence.
    proc, port = start_up(tiny_path, tmp_path_factory.mktemp("up-logs"), 2, "--restart-backoff", "3")
    c = Cluster(proc, port)
    try:
        ok = wait(
            lambda: all(w["status"] == "healthy" for w in c.workers().values()) and len(c.workers()) == 2, 90
        )
        assert ok, "the cluster did not come up"
        yield c
    finally:
        stop(proc)


def test_a_keyed_deployment_serves_and_a_wrong_key_gets_401(tiny_path, tmp_path):
    """`kvyard up --api-key`: the router asks clients for the key and passes it to its workers (which get it in
    their environment, so it is not on their command lines). Its deployment file's server section reaches the
    workers too."""
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text("server:\n  served_model_name: tiny-from-file\ncluster:\n  replicas: 1\n")
    proc, port = start_up(tiny_path, tmp_path, 1, "--api-key", "up-secret", "--config", str(deploy))
    url = f"http://127.0.0.1:{port}"
    try:
        keyed = {"authorization": "Bearer up-secret"}
        assert wait(lambda: httpx.get(url + "/health", trust_env=False).status_code == 200, 90)
        r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, headers=keyed,
                       timeout=30, trust_env=False)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
        for headers in ({}, {"authorization": "Bearer wrong"}):
            r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, headers=headers,
                           timeout=30, trust_env=False)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        worker = f"http://127.0.0.1:{port + 1}"
        assert httpx.get(worker + "/v1/models", trust_env=False).status_code == 401  # the worker is keyed too
        models = httpx.get(worker + "/v1/models", headers=keyed, trust_env=False).json()["data"]
        assert [m["id"] for m in models] == ["tiny-from-file"]
        cmdlines = [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in children(proc.pid)]
        assert cmdlines and not any(b"up-secret" in c for c in cmdlines)
    finally:
        stop(proc)


def test_openai_client_through_the_router(cluster, tiny_path):
    client = OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == [str(tiny_path)]
    chat = client.chat.completions.create(
        model=str(tiny_path),
        messages=[{"role": "user", "content": "Hi!"}],
        max_tokens=6,
        extra_body={"ignore_eos": True},
    )
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 6
    stream = client.completions.create(
        model=str(tiny_path),
        prompt="The quick brown fox",
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 8
    assert "".join(c.choices[0].text for c in chunks if c.choices)
    bad = httpx.post(cluster.url + "/v1/completions", json={"prompt": "x", "max_tokens": -1}, trust_env=False)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"  # the worker's own error


def test_kv_policy_sends_a_follow_up_to_the_worker_holding_its_prefix(cluster, tiny_path):
    client = OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)

    def ask(system: str, question: str) -> str:
        raw = client.chat.completions.with_raw_response.create(
            model=str(tiny_path),
            max_tokens=4,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        )
        return raw.headers["x-kvyard-worker"]

    for system in (SYSTEM, "Continuous batching admits requests every step. " * 6):
        first = ask(system, "What is a block?")
        time.sleep(0.8)  # past the predicted-state TTL: only the event-fed index knows where the prefix is
        assert [ask(system, f"Follow-up number {i}?") for i in range(3)] == [first] * 3
    metrics = httpx.get(cluster.url + "/metrics", trust_env=False).text
    assert 'kvyard_router_decisions_total{policy="kv",reason="affinity"}' in metrics


def test_killing_a_worker_mid_run(cluster, tiny_path):
    body = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
    runs = start_streams(cluster.url, body, 6)
    victim = cluster.worker_urls[0]
    victim_pid = cluster.worker_pid(victim)
    os.kill(victim_pid, signal.SIGKILL)
    errors = errors_after_losing(runs, victim)
    assert errors, "none of the six streams was on the killed worker"
    assert all(e["code"] == "worker_failed" and "cut" in e["message"] for e in errors)
    assert wait(lambda: cluster.workers()[victim]["status"] == "dead", 5)
    for _ in range(4):  # new requests go to the live worker, even with a prefix only the dead one held
        r = httpx.post(
            cluster.url + "/v1/completions",
            json={"prompt": "Once upon a time", "max_tokens": 3},
            timeout=30,
            trust_env=False,
        )
        assert r.status_code == 200 and r.headers["x-kvyard-worker"] == cluster.worker_urls[1]
    # kvyard up reaps the dead worker (no zombie) and starts it again; the router re-admits it.
    assert wait(lambda: not any(Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")
                                for pid in children(cluster.proc.pid)), 3)  # the supervisor looks every 0.5 s
    assert wait(lambda: cluster.workers()[victim]["status"] == "healthy", 60), cluster.workers()[victim]
    assert cluster.worker_pid(victim) != victim_pid
    served = workers_serving_until(cluster.url, victim)
    assert victim in served, served


def test_sigterm_stops_the_router_and_every_worker(cluster):
    pids = children(cluster.proc.pid)
    assert len(pids) == 2
    cluster.proc.send_signal(signal.SIGTERM)
    assert cluster.proc.wait(30) == 0
    assert all(gone(p) for p in pids)


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False
