"""The router's credentials and its bad workers: `--api-key` for clients (401 otherwise, through the
official openai client), the workers' key passed on, a worker that refuses the router's key reported as
refused with the reason (not "pending" forever), a malformed URL a 400, an unreachable one shown with its
error, and either removed with DELETE /workers."""

import socket

import httpx
import openai
import pytest

from tests.router.harness import running_router, running_worker
from tests.server.harness import wait_until

WORKER_KEY, ROUTER_KEY = "worker-secret", "router-secret"


@pytest.fixture(scope="module")
def keyed_worker(tiny_path):
    from kvyard.server.async_engine import AsyncEngine
    from tests.server.conftest import tiny_engine_config

    engine = AsyncEngine.from_config(tiny_engine_config(tiny_path, num_threads=1))
    with running_worker(engine, api_key=WORKER_KEY) as srv:
        yield srv
    engine.shutdown()


def client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30)


def test_a_keyed_cluster_serves_and_a_wrong_key_gets_401(keyed_worker, tokenizer, tiny_path):
    with running_router(tokenizer, workers=[keyed_worker.url], model=str(tiny_path), api_key=ROUTER_KEY,
                        worker_api_key=WORKER_KEY) as router:
        assert wait_until(lambda: router.workers()[keyed_worker.url]["status"] == "healthy", 20)
        out = client(router.url, ROUTER_KEY).completions.create(model=str(tiny_path), prompt="The quick",
                                                                max_tokens=4, extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 4
        for key in (WORKER_KEY, "wrong"):  # the workers' key is not the router's
            with pytest.raises(openai.AuthenticationError) as e:
                client(router.url, key).completions.create(model=str(tiny_path), prompt="x", max_tokens=1)
            assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
        assert httpx.get(router.url + "/workers", trust_env=False).status_code == 401
        assert httpx.get(router.url + "/health", trust_env=False).status_code == 200  # open, as on workers


def test_one_key_serves_both_sides(keyed_worker, tokenizer, tiny_path):
    with running_router(tokenizer, workers=[keyed_worker.url], model=str(tiny_path), api_key=WORKER_KEY) as router:
        assert wait_until(lambda: router.workers()[keyed_worker.url]["status"] == "healthy", 20)
        chat = client(router.url, WORKER_KEY).chat.completions.create(
            model=str(tiny_path), messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
            extra_body={"ignore_eos": True})
        assert chat.usage.completion_tokens == 3
        assert client(router.url, WORKER_KEY).models.list().data[0].id


def test_a_worker_that_refuses_the_routers_key_is_reported(keyed_worker, tokenizer, tiny_path):
    with running_router(tokenizer, workers=[keyed_worker.url], model=str(tiny_path), register_timeout=5) as router:
        assert wait_until(lambda: router.workers()[keyed_worker.url]["status"] == "refused", 10), router.workers()
        error = router.workers()[keyed_worker.url]["error"]
        assert "401" in error and "--api-key" in error, error
        r = httpx.post(router.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, trust_env=False)
        assert r.status_code == 503


def test_bad_worker_urls_are_refused_or_shown_and_can_be_removed(keyed_worker, tokenizer, tiny_path):
    with running_router(tokenizer, workers=[keyed_worker.url], model=str(tiny_path),
                        worker_api_key=WORKER_KEY) as router:
        add = lambda url: httpx.post(router.url + "/workers", json={"url": url}, timeout=10, trust_env=False)  # noqa: E731
        for bad in ("localhost:8001", "ftp://127.0.0.1:1", "http://127.0.0.1:99999", "http://h:1/path"):
            r = add(bad)
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_worker_url", (bad, r.text)
            assert bad not in router.workers()
        with socket.socket() as s:  # a port nothing listens on
            s.bind(("127.0.0.1", 0))
            dead = f"http://127.0.0.1:{s.getsockname()[1]}"
        r = add(dead)
        assert r.status_code == 502 and r.json()["error"]["code"] == "worker_unreachable"
        shown = router.workers()[dead]
        assert shown["status"] == "pending" and "unreachable" in shown["error"], shown
        assert wait_until(lambda: "ConnectError" in (router.workers()[dead]["error"] or ""), 5)  # health checks
        r = httpx.delete(router.url + "/workers/" + dead, trust_env=False)
        assert r.status_code == 200 and dead not in router.workers()
        assert httpx.delete(router.url + "/workers", params={"url": dead}, trust_env=False).status_code == 404
        assert router.workers()[keyed_worker.url]["status"] == "healthy"
