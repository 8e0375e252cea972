"""A LoRA adapter's requests go only to workers serving it, as the router learns from their /kv/config, which
follows adapters loaded and unloaded at run time; the salt a worker names is the adapter's content digest."""

import httpx

from tests.lora.adapters import make_adapter
from tests.router.harness import running_router, running_worker
from tests.server.harness import wait_until


def _served_by(url: str, model: str, prompt: str) -> str:
    r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 2}, timeout=30,
                   trust_env=False)
    assert r.status_code == 200, r.text
    return r.headers["x-kvyard-worker"]


def test_adapter_requests_go_to_the_workers_serving_the_adapter(make_engine, tiny_path, tokenizer, tmp_path):
    adapter = str(make_adapter(tiny_path, tmp_path / "a"))
    with running_worker(make_engine(lora_adapters={"a": adapter})) as one, \
            running_worker(make_engine(), enable_lora_runtime_updates=True) as two, \
            running_router(tokenizer, workers=[one.url, two.url], model=str(tiny_path), policy="round-robin") as router:
        assert wait_until(lambda: all(w["status"] == "healthy" for w in router.workers().values()), 20)
        digest = httpx.get(one.url + "/kv/config", timeout=10, trust_env=False).json()["lora_adapters"]["a"]
        assert len(digest) == 64
        assert {_served_by(router.url, "a", f"prompt {i}") for i in range(6)} == {one.url}
        base = str(tiny_path)
        assert {_served_by(router.url, base, f"base prompt {i}") for i in range(4)} == {one.url, two.url}  # in turns

        # loaded on the second worker at run time: the router learns it at its next health check
        load = httpx.post(two.url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": adapter},
                          timeout=30, trust_env=False)
        assert load.status_code == 200
        state = router.state
        assert wait_until(lambda: all(w.serves_adapter("a") for w in state.registry.routable()), 10)
        httpx.post(one.url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": adapter}, timeout=30,
                   trust_env=False)  # refused (runtime updates are off there): nothing changes on one
        assert httpx.post(two.url + "/v1/unload_lora_adapter", json={"lora_name": "a"}, timeout=30,
                          trust_env=False).status_code == 200
        assert wait_until(lambda: not any(w.serves_adapter("a") for w in state.registry.routable()
                                          if w.url == two.url), 10)
        assert {_served_by(router.url, "a", f"later prompt {i}") for i in range(4)} == {one.url}
