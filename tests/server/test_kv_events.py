"""A worker publishes its prefix cache's changes over ZeroMQ; replaying them equals its snapshot."""

import time

import httpx
import msgspec
import zmq

from kvyard.engine.kv_events import BlockStored, apply_events
from kvyard.server.kv_config import KVConfig, local_kv_config
from kvyard.server.kv_events import KVEventBatch, KVEventPublisher, KVSnapshot
from tests.server.harness import running_server

PROMPT = "The quick brown fox jumps over the lazy dog. " * 6


def subscribe(endpoint: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def receive(sock: zmq.Socket, until: float) -> list[KVEventBatch]:
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    out = []
    while time.monotonic() < until:
        if sock.poll(50):
            out.append(decoder.decode(sock.recv()))
    return out


def test_events_replay_to_the_snapshot_and_config_describes_the_scheme(make_engine):
    engine = make_engine(num_threads=1)
    with running_server(engine, kv_events_port=0) as srv:
        publisher = srv.server.config.app.state.kv_events
        publisher.heartbeat_s = 0.2
        try:
            config = msgspec.json.decode(httpx.get(srv.url + "/kv/config").content, type=KVConfig)
            assert config == local_kv_config(
                config.model,
                engine.block_size,
                engine.tokenizer,
                instance_id=publisher.instance_id,
                events_endpoint=publisher.endpoint,
            )
            assert config.events_endpoint.startswith("tcp://127.0.0.1:")
            sock = subscribe(config.events_endpoint)
            time.sleep(0.3)  # PUB/SUB: let the subscription reach the publisher first
            for suffix in ("one", "two"):
                r = httpx.post(
                    srv.url + "/v1/completions",
                    timeout=30,
                    json={"prompt": PROMPT + suffix, "max_tokens": 20, "ignore_eos": True},
                )
                assert r.status_code == 200
            batches = receive(sock, time.monotonic() + 0.6)
            sock.close()
            snap = msgspec.json.decode(httpx.get(srv.url + "/kv/snapshot").content, type=KVSnapshot)
        finally:
            publisher.close()
    with_events = [b for b in batches if b.events]
    assert with_events and any(not b.events for b in batches)  # heartbeats while idle
    assert [b.seq for b in with_events] == list(range(1, len(with_events) + 1))  # one number per batch
    assert {b.instance_id for b in batches} == {snap.instance_id} == {config.instance_id}
    hashes: set[bytes] = set()
    for b in with_events:
        apply_events(hashes, b.events)
    assert snap.seq == with_events[-1].seq
    assert {h.hex() for h in hashes} == set(snap.block_hashes) and hashes
    assert any(isinstance(ev, BlockStored) and ev.parent_hash is None for b in with_events for ev in b.events)


def test_without_events_config_says_so_and_there_is_no_snapshot(engine):
    with running_server(engine) as srv:
        config = httpx.get(srv.url + "/kv/config").json()
        assert config["events_endpoint"] is None and config["block_size"] == engine.block_size
        r = httpx.get(srv.url + "/kv/snapshot")
        assert r.status_code == 404 and "kv-events-port" in r.json()["error"]["message"]


def test_publisher_numbers_batches_and_mirrors_the_cache():
    pub = KVEventPublisher(port=0, heartbeat_s=0.05)
    pub.start({b"a" * 32})
    sock = subscribe(pub.endpoint)
    time.sleep(0.2)
    pub.put([BlockStored([b"b" * 32], b"a" * 32, [1, 2], 2)])
    batches = receive(sock, time.monotonic() + 0.3)
    sock.close()
    snap = pub.snapshot()
    pub.close()
    assert snap.seq == 1 and set(snap.block_hashes) == {(b"a" * 32).hex(), (b"b" * 32).hex()}
    assert [b.seq for b in batches if b.events] == [1]
