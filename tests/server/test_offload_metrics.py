"""KV offload in /metrics: a prefix evicted from a small pool comes back from host memory, and the tier's hit
tokens, writes and size show per tier."""

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvyard.loader.checkpoint import load_checkpoint
from kvyard.server.async_engine import AsyncEngine
from tests.server.conftest import tiny_engine_config
from tests.server.harness import running_server, wait_until


def _offload(url: str) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", trust_env=False).text):
        for sample in family.samples:
            if sample.name.startswith("kvyard_kv_offload") and sample.labels.get("tier", "host") == "host":
                label = sample.labels.get("reason", sample.labels.get("decision", sample.labels.get("direction", "")))
                out[sample.name + "/" + label] = sample.value
    return out


def test_tier_hits_reach_the_metrics(tiny_path):
    cfg = load_checkpoint(tiny_path).config
    block_bytes = 4 * 2 * cfg.num_kv_heads * cfg.head_dim * 4 * cfg.num_layers
    engine = AsyncEngine.from_config(tiny_engine_config(tiny_path, block_size=4, kv_cache_memory=24 * block_bytes,
                                                        kv_offload_host_memory="4MiB"))
    prompts = [list(range(5, 35)), list(range(100, 160)), list(range(200, 260)), list(range(5, 35))]
    try:
        with running_server(engine) as server:
            for prompt in prompts:  # the second and third push the first out of the 24-block pool
                r = httpx.post(server.url + "/v1/completions", trust_env=False, timeout=60, json={
                    "prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True})
                assert r.status_code == 200, r.text
            # the first prompt's 7 leading blocks (its last token is always computed) came back
            assert wait_until(lambda: _offload(server.url).get("kvyard_kv_offload_hit_tokens_total/") == 7 * 4), \
                _offload(server.url)
            m = _offload(server.url)
            assert m["kvyard_kv_offload_stored_blocks_total/"] >= 7 and m["kvyard_kv_offload_bytes/"] > 0
            assert m["kvyard_kv_offload_decisions_total/load"] == 7 and m["kvyard_kv_offload_decisions_total/recompute"] == 0
            block = m["kvyard_kv_offload_moved_bytes_total/load"] / 7  # the 7 blocks' KV came back
            assert block > 0 and m["kvyard_kv_offload_moved_bytes_total/store"] == block * m[
                "kvyard_kv_offload_stored_blocks_total/"]
            assert m["kvyard_kv_offload_load_seconds_total/"] > 0
    finally:
        engine.shutdown()
