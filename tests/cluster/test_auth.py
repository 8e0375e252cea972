"""The cluster token (kvyard/cluster/auth.py): only the fleet gets into /kv/*, the KV events and KV transfer."""

import time

import httpx
import pytest
import zmq

from kvyard.cluster.auth import present_token
from kvyard.disagg.layout import KVLayout
from kvyard.disagg.payload import KVTransferError
from kvyard.disagg.zmq_transport import KVFetcher, KVSource
from kvyard.server.async_engine import AsyncEngine
from kvyard.server.kv_events import KVEventPublisher
from tests.disagg.conftest import BLOCK, Offer, make_caches
from tests.router.harness import running_router, running_worker
from tests.server.conftest import tiny_engine_config
from tests.server.harness import wait_until

TOKEN = "fleet-token-0123456789abcdef"


@pytest.fixture(scope="module")
def engine(tiny_path):
    eng = AsyncEngine.from_config(tiny_engine_config(tiny_path))
    yield eng
    eng.shutdown()


def test_kv_transfer_takes_only_fetchers_with_the_token():
    caches = make_caches()
    layout = KVLayout.of(caches, BLOCK)
    with KVSource(caches, BLOCK, token=TOKEN) as source:
        offer = Offer("t1", [2, 5]).offer_to(source)
        for stranger in (None, "another-fleet-token-0123"):
            with KVFetcher(allow_shm=False, token=stranger) as fetcher:
                t0 = time.monotonic()
                with pytest.raises(KVTransferError, match="refused this worker's cluster token"):
                    fetcher.fetch(source.endpoint, "t1", layout, offer.hashes, timeout_s=10)
                assert time.monotonic() - t0 < 5  # told at the handshake, not after the timeout
        with KVFetcher(allow_shm=False, token=TOKEN) as fetcher:
            payload = fetcher.fetch(source.endpoint, "t1", layout, offer.hashes, timeout_s=10)
            assert payload.block_hashes == offer.hashes


def test_kv_events_reach_only_subscribers_with_the_token():
    publisher = KVEventPublisher(port=0, heartbeat_s=0.1, token=TOKEN)
    publisher.start(set())
    ctx = zmq.Context()
    socks = {}
    try:
        for name, token in (("fleet", TOKEN), ("stranger", "another-fleet-token-0123"), ("anonymous", None)):
            sock = ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            present_token(sock, token)
            sock.connect(publisher.endpoint)
            socks[name] = sock
        got = dict.fromkeys(socks, 0)
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            for name, sock in socks.items():
                while sock.poll(0):
                    sock.recv()
                    got[name] += 1
            time.sleep(0.05)
        assert got["fleet"] > 0 and got["stranger"] == 0 and got["anonymous"] == 0, got  # its heartbeats
    finally:
        for sock in socks.values():
            sock.close()
        ctx.term()
        publisher.close()


def test_kv_routes_need_the_token_or_the_api_key(engine):
    with running_worker(engine, cluster_token=TOKEN, kv_events_port=0) as worker:
        assert httpx.get(worker.url + "/kv/config", trust_env=False).status_code == 401
        assert httpx.get(worker.url + "/kv/config", headers={"x-kvyard-cluster-token": "wrong-token-0123456789"},
                         trust_env=False).status_code == 401
        assert httpx.get(worker.url + "/kv/config", headers={"x-kvyard-cluster-token": TOKEN},
                         trust_env=False).status_code == 200
        assert httpx.get(worker.url + "/v1/models", trust_env=False).status_code == 200  # no API key: open
    with running_worker(engine, cluster_token=TOKEN, api_key="operator-key") as worker:
        keyed = {"authorization": "Bearer operator-key"}
        assert httpx.get(worker.url + "/kv/config", headers=keyed, trust_env=False).status_code == 200
        # The token opens only the cluster's own routes, not the API.
        assert httpx.get(worker.url + "/v1/models", headers={"x-kvyard-cluster-token": TOKEN},
                         trust_env=False).status_code == 401


def test_a_router_without_the_token_is_refused_with_the_reason(engine, tokenizer, tiny_path):
    with running_worker(engine, cluster_token=TOKEN) as worker:
        with running_router(tokenizer, workers=[worker.url], model=str(tiny_path), register_timeout=5) as router:
            assert wait_until(lambda: router.workers()[worker.url]["status"] == "refused", 10)
            assert "no cluster token" in router.workers()[worker.url]["error"]
        with running_router(tokenizer, workers=[worker.url], model=str(tiny_path), cluster_token=TOKEN) as router:
            assert wait_until(lambda: router.workers()[worker.url]["status"] == "healthy", 10)
            r = httpx.post(router.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=30,
                           trust_env=False)
            assert r.status_code == 200
