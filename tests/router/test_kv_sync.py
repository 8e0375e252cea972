"""The router's prefix index follows a worker's events, resyncs after a gap or a restart, and the
hash handshake refuses a worker that would hash differently."""

import asyncio
import logging

import httpx
import pytest

from kvyard.router.config import RouterSettings
from kvyard.router.handshake import HandshakeError
from kvyard.router.kv_subscriber import KVEventSubscriber
from kvyard.router.predicted import PredictedCache
from kvyard.router.prefix_index import PrefixIndex
from kvyard.router.registry import WorkerRegistry
from kvyard.router.worker import WorkerStatus
from kvyard.server.kv_events import KVEventBatch
from tests.router.harness import running_router, running_worker

PROMPT = "Paged attention keeps the KV cache in fixed-size blocks. " * 5


async def complete(client: httpx.AsyncClient, url: str, prompt: str) -> None:
    r = await client.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 4}, timeout=30)
    assert r.status_code == 200


async def wait_for(predicate, timeout: float = 10.0) -> bool:
    for _ in range(int(timeout / 0.02)):
        if predicate():
            return True
        await asyncio.sleep(0.02)
    return predicate()


def test_index_follows_events_and_resyncs_after_a_gap_and_a_restart(make_engine):
    engine = make_engine()
    with running_worker(engine) as srv:
        publisher = srv.server.config.app.state.kv_events

        def published() -> set[bytes]:
            return {bytes.fromhex(h) for h in publisher.snapshot().block_hashes}

        async def scenario() -> None:
            index = PrefixIndex()
            async with httpx.AsyncClient(trust_env=False) as client:
                sub = KVEventSubscriber(srv.url, publisher.endpoint, index, client)
                sub.start()
                try:
                    await complete(client, srv.url, PROMPT)  # events may be lost before SUB joins: resync
                    assert await wait_for(lambda: published() and index.hashes(srv.url) == published())
                    await complete(client, srv.url, PROMPT + " and more")
                    assert await wait_for(lambda: index.hashes(srv.url) == published())
                    assert sub.seq == publisher.seq
                    resyncs = sub.resyncs
                    # A gap: batches seq+1..seq+4 never arrived. The subscriber resyncs from the snapshot.
                    index.add(srv.url, [b"stale" * 6 + b"xx"])
                    await sub.handle(KVEventBatch(sub.instance_id, sub.seq + 5, 0.0, []))
                    assert sub.resyncs == resyncs + 1 and index.hashes(srv.url) == published()
                    # A restart: another instance id. Resync again (the real publisher answers).
                    await sub.handle(KVEventBatch("another-instance", 1, 0.0, []))
                    assert sub.resyncs == resyncs + 2 and sub.instance_id == publisher.instance_id
                    # Back in step: the next real events apply without a resync.
                    await complete(client, srv.url, "Continuous batching admits requests every step. " * 4)
                    assert await wait_for(
                        lambda: index.hashes(srv.url) == published() and sub.seq == publisher.seq
                    )
                    assert sub.resyncs == resyncs + 2
                finally:
                    await sub.stop()

        asyncio.run(scenario())


def registry_for(tokenizer, **settings) -> tuple[WorkerRegistry, httpx.AsyncClient]:
    client = httpx.AsyncClient(trust_env=False)
    return WorkerRegistry(
        RouterSettings(**settings), tokenizer, PrefixIndex(), PredictedCache(1.0), client
    ), client


def test_handshake_refuses_a_block_size_mismatch_loudly(make_engine, tokenizer, caplog):
    with running_worker(make_engine(block_size=8)) as odd, running_worker(make_engine()) as good:

        async def scenario() -> None:
            reg, client = registry_for(tokenizer, block_size=16)
            async with client:
                w = await reg.add(good.url)
                assert w.status is WorkerStatus.HEALTHY
                with (
                    caplog.at_level(logging.ERROR, logger="kvyard.router.handshake"),
                    pytest.raises(HandshakeError, match="block_size: expected 16, worker has 8"),
                ):
                    await reg.add(odd.url)
                assert reg.workers[odd.url].status is WorkerStatus.REFUSED
                assert [w.url for w in reg.routable()] == [good.url]
                await reg.stop()

        asyncio.run(scenario())
        assert any("refusing worker" in r.message for r in caplog.records)


def test_router_refuses_a_worker_with_another_tokenizer(make_engine, tokenizer):
    other = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    other.chat_template = "{{ messages[0]['content'] }}"  # same vocabulary, other chat template
    with running_worker(make_engine()) as srv, running_router(other, workers=[]) as router:
        r = httpx.post(router.url + "/workers", json={"url": srv.url}, timeout=10, trust_env=False)
        assert r.status_code == 409 and "tokenizer_fingerprint" in r.json()["error"]["message"]
        assert router.workers()[srv.url]["status"] == "refused"
        assert httpx.get(router.url + "/health", trust_env=False).status_code == 503
        r = httpx.post(
            router.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, trust_env=False
        )
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_worker_available"
