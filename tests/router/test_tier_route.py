"""Routing knows the offload tiers: two replicas share a Redis tier, and a prefix one of them computed (since
evicted from its pool) is routed to a replica that can load it from Redis, not to one that must recompute it."""

import httpx

from kvyard.engine.block_manager import block_hashes
from kvyard.loader.checkpoint import load_checkpoint
from kvyard.router.placement import route_request
from tests.offload.conftest import redis_server  # noqa: F401  (the fixture)
from tests.router.harness import running_router, running_worker
from tests.server.harness import wait_until

BLOCK = 16
PROMPT = "Paged attention keeps the KV cache in fixed-size blocks, and a router sends each prompt home. " * 4
FLOOD = [f"Filler text number {i} that pushes the first prompt out of a small pool of KV blocks. " * 5
         for i in range(4)]


def _complete(url: str, prompt: str) -> httpx.Response:
    r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0.0},
                   timeout=60, trust_env=False)
    assert r.status_code == 200, r.text
    return r


def test_a_prefix_in_the_shared_redis_tier_goes_to_a_replica_that_can_load_it(make_engine, tokenizer, tiny_path,
                                                                             redis_server):  # noqa: F811
    shared = dict(kv_offload_redis=redis_server.url, kv_offload_write="through", kv_cache_memory=_pool(tiny_path, 24))
    a, b, c = make_engine(**shared), make_engine(**shared), make_engine(kv_cache_memory=_pool(tiny_path, 24))
    with (running_worker(a) as wa, running_worker(b) as wb, running_worker(c) as wc,
          running_router(tokenizer, workers=[wa.url, wb.url, wc.url]) as router):
        subs = router.state.registry.subscribers
        assert wait_until(lambda: len(subs) == 3 and all(s.seq >= 0 for s in subs.values()), timeout=20)
        # A computes the prompt (and writes it to Redis), then other prompts push it out of A's pool.
        for prompt in [PROMPT, *FLOOD]:
            _complete(wa.url, prompt)
        ids = tokenizer(PROMPT).input_ids
        hashes = block_hashes(ids, BLOCK)[: (len(ids) - 1) // BLOCK]
        index = router.state.placement.index
        assert wait_until(lambda: all(index.tiers.credit(wb.url, h) > 0 for h in hashes), timeout=20)
        assert not any(index.holds(wa.url, h) for h in hashes)  # gone from A's pool
        req = route_request(ids, BLOCK)
        overlaps = router.state.placement.overlaps(req, router.state.placement.live())
        assert overlaps[wa.url] > 0 and overlaps[wb.url] > 0 and overlaps[wc.url] == 0
        served = _complete(router.url, PROMPT).headers["x-kvyard-worker"]
        assert served in (wa.url, wb.url)
        chosen = a if served == wa.url else b
        assert wait_until(lambda: chosen.stats().offload.get("redis", {}).get("restored", 0) == len(hashes))


def _pool(path, blocks: int) -> int:
    """Bytes of a KV pool of this many 16-token blocks (fp32)."""
    cfg = load_checkpoint(path).config
    return blocks * BLOCK * 2 * cfg.num_kv_heads * cfg.head_dim * 4 * cfg.num_layers
