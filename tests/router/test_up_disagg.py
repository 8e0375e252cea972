"""`kvyard up --prefill 1 --decode 1` end to end: a prefill and a decode worker process behind the router; a
long prompt is prefilled remotely, decoded on the decode worker, and answered through the `openai` client."""

import subprocess
import sys

import httpx
from openai import OpenAI

from tests.router.test_up_cluster import free_port_run, wait


def test_up_with_prefill_and_decode_workers(tiny_path, tmp_path):
    port = free_port_run(3)
    cmd = [sys.executable, "-m", "kvyard.cli.main", "up", "--prefill", "1", "--decode", "1",
           "--model", str(tiny_path), "--router-port", str(port), "--num-threads", "1",
           "--log-dir", str(tmp_path), "--log-level", "warning", "--health-interval", "0.3",
           "--disagg-threshold", "32", "--serve-args", "--dtype float32 --kv-cache-memory 2MiB --block-size 4"]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        def workers() -> list[dict]:
            return httpx.get(url + "/workers", timeout=5, trust_env=False).json()["workers"]

        assert wait(lambda: [w["status"] for w in workers()] == ["healthy"] * 2, 90), "the cluster did not come up"
        assert sorted(w["role"] for w in workers()) == ["decode", "prefill"]
        client = OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        prompt = "Paged attention keeps the KV cache in fixed-size blocks. " * 6
        out = client.completions.create(model=str(tiny_path), prompt=prompt, max_tokens=6, temperature=0.0)
        assert out.choices[0].finish_reason in ("length", "stop")
        metrics = httpx.get(url + "/metrics", timeout=5, trust_env=False).text
        assert 'kvyard_router_disagg_decisions_total{decision="remote"} 1.0' in metrics
    finally:
        proc.terminate()
        proc.wait(30)
