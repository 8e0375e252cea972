"""Autoscaling on the simulated Ray cluster (tests/cluster/conftest.py): a burst of streams grows the colocated
replicas to the maximum, and light load shrinks them to the minimum, draining each one first, so that no
stream of the light load is cut. Every change is in the router's metrics."""

import json
import threading
import time

import httpx
import pytest

pytest.importorskip("ray")
from kvyard.cluster.config import AutoscaleConfig, ClusterConfig  # noqa: E402
from kvyard.cluster.controller import RayController  # noqa: E402
from tests.cluster.conftest import SLOT  # noqa: E402
from tests.router.harness import running_router  # noqa: E402
from tests.server.harness import wait_until  # noqa: E402

SERVE_ARGS = ["--dtype", "float32", "--kv-cache-memory", "2MiB", "--max-num-batched-tokens", "256",
              "--max-num-seqs", "2", "--log-level", "warning"]  # 2 at a time: a burst queues at once
SCALE = AutoscaleConfig(min_replicas=1, max_replicas=3, target_waiting=1.0, up_after_s=0.5, down_after_s=2.0,
                        cooldown_s=1.0, interval_s=0.25, drain_timeout_s=60)


class StreamLoad:
    """`concurrency` threads, each streaming completions one after another until stopped; every stream's
    outcome is kept: 'ok' (ended with [DONE] and no error event) or what went wrong."""

    def __init__(self, url: str, concurrency: int, max_tokens: int):
        self.url, self.max_tokens = url, max_tokens
        self.stop_event = threading.Event()
        self.outcomes: list[str] = []
        self.threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(concurrency)]
        for t in self.threads:
            t.start()

    def _loop(self) -> None:
        body = {"prompt": "Once upon a time", "max_tokens": self.max_tokens, "ignore_eos": True, "stream": True}
        while not self.stop_event.is_set():
            try:
                with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=60,
                                  trust_env=False) as r:
                    lines = [ln[5:].strip() for ln in r.iter_lines() if ln.startswith("data:")]
                errors = [ln for ln in lines if ln != "[DONE]" and "error" in json.loads(ln)]
                ok = r.status_code == 200 and lines[-1:] == ["[DONE]"] and not errors
                self.outcomes.append("ok" if ok else f"{r.status_code}: {errors or lines[-1:]}")
            except httpx.HTTPError as e:
                self.outcomes.append(f"client error: {e}")

    def stop(self) -> list[str]:
        self.stop_event.set()
        for t in self.threads:
            t.join(90)
        assert not any(t.is_alive() for t in self.threads), "a stream hung"
        return self.outcomes


def test_a_burst_scales_to_the_maximum_and_light_load_back_to_the_minimum(ray_cluster, tiny_path, tokenizer):
    config = ClusterConfig(replicas=1, resources=dict(SLOT), placement_timeout=60, ready_timeout=120,
                           autoscale=SCALE)
    controller = RayController(config, ["--model", str(tiny_path), *SERVE_ARGS], config.roles())
    urls = controller.start_all()
    try:
        with running_router(tokenizer, controller, workers=urls, model=str(tiny_path), health_interval=0.2) as router:
            serving = lambda: len(controller.autoscaler.serving())  # noqa: E731
            # The burst starts once the router has admitted the first replica (CI once sent two requests before)
            assert wait_until(lambda: [w["status"] for w in router.workers().values()] == ["healthy"], 30)
            burst = StreamLoad(router.url, concurrency=12, max_tokens=150)
            grew = wait_until(lambda: serving() == 3, 150)
            outcomes = burst.stop()
            assert grew, f"the burst did not grow the replicas to 3: {controller.autoscaler.history}"
            assert outcomes and outcomes.count("ok") == len(outcomes), outcomes
            assert len({r.node_id for r in controller.replicas}) == 3

            light = StreamLoad(router.url, concurrency=1, max_tokens=100)
            shrank = wait_until(lambda: serving() == 1, 90)
            time.sleep(0.5)
            outcomes = light.stop()
            assert shrank, f"light load did not shrink the replicas to 1: {controller.autoscaler.history}"
            assert outcomes and outcomes.count("ok") == len(outcomes), outcomes  # none cut by a drain
            assert set(router.workers()) == {r.url for r in controller.replicas}  # the retired ones are gone

            metrics = httpx.get(router.url + "/metrics", trust_env=False).text
            up = 'kvyard_router_autoscale_decisions_total{direction="up",outcome="done",reason="queue"} 2.0'
            down = 'kvyard_router_autoscale_decisions_total{direction="down",outcome="done",reason="light_load"} 2.0'
            assert up in metrics and down in metrics, [ln for ln in metrics.splitlines() if "autoscale" in ln]
            print("autoscaler history:", controller.autoscaler.history)
    finally:
        controller.stop()
