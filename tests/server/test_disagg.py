"""Disaggregated serving between two real servers (fp32, tiny model): a prefill worker computes the KV, a
decode worker pulls it and generates. Outputs equal colocated serving; every failure falls back to local
prefill and completes; nothing leaks, checked through the workers' own counters."""

import concurrent.futures
import socket

import httpx
import pytest

from kvyard.server.async_engine import AsyncEngine
from tests.server.conftest import tiny_engine_config
from tests.server.harness import running_server, wait_until

PROMPT = "Paged attention keeps the KV cache in fixed-size blocks. Continuous batching admits requests. " * 2


@pytest.fixture(scope="module")
def engines(tiny_path):
    made = [AsyncEngine.from_config(tiny_engine_config(tiny_path, block_size=4, num_threads=1)) for _ in range(3)]
    yield made
    for eng in made:
        eng.shutdown()


@pytest.fixture(scope="module")
def servers(engines):
    prefill, decode, colocated = engines
    with (running_server(prefill, role="prefill", kv_transfer_port=0, kv_hold_timeout=3.0) as p,
          running_server(decode, role="decode", kv_fetch_timeout=1.0) as d,
          running_server(colocated) as c):
        yield p, d, c


def ids_of(engine: AsyncEngine, text: str) -> list[int]:
    return engine.tokenizer(text).input_ids


def complete(url: str, ids: list[int], **extra: object) -> dict:
    body = {"prompt": ids, "max_tokens": 10, "temperature": 0.0, "ignore_eos": True, **extra}
    r = httpx.post(url + "/v1/completions", json=body, timeout=60, trust_env=False)
    assert r.status_code == 200, r.text
    return r.json()


def prefill(url: str, ids: list[int]) -> dict:
    r = httpx.post(url + "/kv/prefill", json={"prompt_token_ids": ids}, timeout=60, trust_env=False)
    assert r.status_code == 200, r.text
    return r.json()


def metric(url: str, name: str, labels: str = "") -> float:
    text = httpx.get(url + "/metrics", timeout=10, trust_env=False).text
    for line in text.splitlines():
        if line.startswith(name + (labels and "{" + labels + "}")) and " " in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def all_blocks_free(url: str) -> bool:
    return (metric(url, "kvyard_kv_cache_free_blocks") == metric(url, "kvyard_kv_cache_blocks")
            and metric(url, "kvyard_kv_held_transfers") == 0)


def test_disaggregated_output_equals_colocated_with_and_without_cache_hits(servers, engines):
    p, d, c = servers
    for text in (PROMPT, PROMPT, PROMPT + " A different ending."):  # cold, fully cached on D, partly cached
        ids = ids_of(engines[0], text)
        params = prefill(p.url, ids)
        assert params["num_blocks"] == (len(ids) - 1) // 4
        got = complete(d.url, ids, kv_transfer_params={k: params[k] for k in ("transfer_id", "endpoint",
                                                                                 "num_blocks")})
        assert got["choices"][0]["text"] == complete(c.url, ids)["choices"][0]["text"]
        # Released by the decode worker's ack once it adopted the KV, well before the 3 s hold timeout.
        assert wait_until(lambda: metric(p.url, "kvyard_kv_held_transfers") == 0, timeout=1.0)
    assert metric(d.url, "kvyard_kv_pulls_total", 'outcome="ok"') == 3
    assert metric(d.url, "kvyard_kv_pulled_bytes_total") > 0
    assert wait_until(lambda: all_blocks_free(p.url)) and all_blocks_free(d.url)


def test_failed_pulls_fall_back_to_local_prefill(servers, engines):
    p, d, c = servers
    ids = ids_of(engines[0], PROMPT + " Fallbacks.")
    want = complete(c.url, ids)["choices"][0]["text"]
    with socket.socket() as s:  # a port nobody listens on: the prefill worker "died"
        s.bind(("127.0.0.1", 0))
        dead = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    params = prefill(p.url, ids)
    other = prefill(p.url, ids_of(engines[0], "Something else entirely, long enough to fill blocks. " * 2))
    cases = {
        "integrity": [{**other, "num_blocks": params["num_blocks"]}],  # KV of another prompt: refused
        "transfer_failed": [{**params, "endpoint": dead}, {**params, "transfer_id": "no-such-transfer"}],
        "prompt_mismatch": [{**params, "num_blocks": 10_000}],
    }
    before = {k: metric(d.url, "kvyard_kv_pulls_total", f'outcome="{k}"') for k in cases}
    for outcome, bad in cases.items():
        for kv in bad:
            kv = {k: kv[k] for k in ("transfer_id", "endpoint", "num_blocks")}
            assert complete(d.url, ids, kv_transfer_params=kv)["choices"][0]["text"] == want
        assert metric(d.url, "kvyard_kv_pulls_total", f'outcome="{outcome}"') == before[outcome] + len(bad)
    # Nobody pulled `params`: its hold times out (kv_hold_timeout=3 s) and every block is free again.
    assert wait_until(lambda: all_blocks_free(p.url), timeout=10) and all_blocks_free(d.url)


def test_fault_storm_leaks_nothing(servers, engines):
    p, d, c = servers
    prompts = [ids_of(engines[0], f"Request {i}: " + PROMPT) for i in range(8)]

    def one(i: int) -> str:
        params = {k: v for k, v in prefill(p.url, prompts[i]).items() if k != "prefill_seconds"}
        if i % 4 == 1:
            params["endpoint"] = "tcp://127.0.0.1:9"  # unreachable
        elif i % 4 == 2:
            params["transfer_id"] += "-wrong"
        elif i % 4 == 3:
            return ""  # prefilled, never pulled: the hold must time out
        return complete(d.url, prompts[i], kv_transfer_params=params, stream=False)["choices"][0]["text"]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(one, range(8)))
    for i, text in enumerate(texts):
        if i % 4 != 3:
            assert text == complete(c.url, prompts[i])["choices"][0]["text"]
    assert wait_until(lambda: all_blocks_free(p.url), timeout=10) and all_blocks_free(d.url)


def test_roles_refuse_what_they_do_not_do(servers, engines):
    p, d, c = servers
    ids = ids_of(engines[0], PROMPT)
    r = httpx.post(d.url + "/kv/prefill", json={"prompt_token_ids": ids}, timeout=30, trust_env=False)
    assert r.status_code == 404 and "does not prefill" in r.json()["error"]["message"]
    kv = {"transfer_id": "x", "endpoint": "tcp://127.0.0.1:9", "num_blocks": 1}
    r = httpx.post(p.url + "/v1/completions", json={"prompt": ids, "max_tokens": 2, "kv_transfer_params": kv},
                   timeout=30, trust_env=False)
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params"
    r = httpx.post(p.url + "/kv/prefill", json={"prompt_token_ids": []}, timeout=30, trust_env=False)
    assert r.status_code == 400
    r = httpx.post(d.url + "/v1/completions", json={"prompt": ids, "kv_transfer_params": {"transfer_id": 3}},
                   timeout=30, trust_env=False)
    assert r.status_code == 400
    roles = {httpx.get(u + "/kv/config", timeout=10, trust_env=False).json()["role"] for u in (p.url, d.url)}
    assert roles == {"prefill", "decode"}


def test_a_model_with_sliding_window_pools_is_served_colocated_only():
    """Window pools give blocks back and keep a second table: the KV transfer would miss them, so the disagg
    roles refuse such a model up front, with the reason."""
    from types import SimpleNamespace

    from kvyard.engine.kv_cache import KVGroups
    from kvyard.errors import ConfigError
    from kvyard.server.disagg import require_one_pool

    require_one_pool(SimpleNamespace(kv_groups=KVGroups(), model_name="dense"))  # type: ignore[arg-type]
    for groups in (KVGroups(window=4096), KVGroups(sliding_window=512, sliding_layers=frozenset({0}))):
        with pytest.raises(ConfigError, match="serve this model colocated"):
            require_one_pool(SimpleNamespace(kv_groups=groups, model_name="gemma"))  # type: ignore[arg-type]
