"""The Redis tier: blocks round-trip through a real redis-server, a damaged value is a counted miss, and a
server that is gone costs a counted, fast miss, never an error."""

import time

import redis

from kvyard.offload.redis_tier import RedisTier
from tests.offload.test_disk_tier import LAYOUT, _block, _packed, _same


def test_blocks_round_trip_and_damage_is_a_counted_miss(redis_server):
    tier = RedisTier(redis_server.url, LAYOUT, "f1")
    h = b"\x07" * 32
    assert h not in tier and tier.put(h, (1, 2, 3, 4), _packed(7))
    tier.flush()
    assert h in tier and tier.stats.stored == 1
    got = RedisTier(redis_server.url, LAYOUT, "f1").get(h, (1, 2, 3, 4))  # another replica reads it
    assert got is not None and _same(got.tensors, _block(7))
    assert RedisTier(redis_server.url, LAYOUT, "f2").get(h, (1, 2, 3, 4)) is None  # another model's KV
    client = redis.Redis.from_url(redis_server.url)
    client.set(tier._key(h), client.get(tier._key(h))[:-5])  # truncated
    assert tier.get(h, (1, 2, 3, 4)) is None and tier.stats.corrupt == 1
    tier.put(b"\x08" * 32, (5,) * 4, _packed(8))
    tier.flush()
    assert 0 < client.ttl(tier._key(b"\x08" * 32)) <= tier.ttl_s


def test_a_stopped_server_is_skipped_fast_and_counted(redis_server):
    tier = RedisTier(redis_server.url, LAYOUT, "f1")
    tier.put(b"\x01" * 32, (1,) * 4, _packed(1))
    tier.flush()
    redis_server.stop()
    started = time.monotonic()
    assert tier.get(b"\x01" * 32, (1,) * 4) is None
    assert time.monotonic() - started < 2.0 and tier.stats.unreachable == 1 and not tier.available
    assert tier.get(b"\x01" * 32, (1,) * 4) is None and tier.stats.unreachable == 1  # skipped, not retried
    assert not tier.put(b"\x02" * 32, (2,) * 4, _packed(2))


def test_the_engine_thread_asks_redis_nothing_to_write_and_a_block_is_written_once(redis_server):
    a, b = RedisTier(redis_server.url, LAYOUT, "f1"), RedisTier(redis_server.url, LAYOUT, "f1")
    h = b"\x09" * 32
    a.client = b.client = None  # any call from here on the caller's thread would fail
    assert a.lacks(h)  # no round trip: the writer thread asks
    a.client = b.client = redis.Redis.from_url(redis_server.url)
    a.put(h, (9,) * 4, _packed(9))
    a.flush()
    b.put(h, (9,) * 4, _packed(9))  # another replica writes the same block: already there, not written again
    b.flush()
    assert a.stats.stored == 1 and b.stats.stored == 0


def test_queued_blocks_are_written_in_one_pipelined_batch_skipping_those_already_there(redis_server):
    a, b = RedisTier(redis_server.url, LAYOUT, "f1"), RedisTier(redis_server.url, LAYOUT, "f1")
    changes: list[list[bytes]] = []
    b.on_change = lambda medium, stored, removed: changes.append(stored)
    blocks = {bytes([i]) * 32: ((i,) * 4, _packed(i)) for i in range(1, 6)}
    first = next(iter(blocks))
    a.put(first, *blocks[first])  # another replica wrote this one already
    a.flush()
    b._write_many([(h, tokens, block) for h, (tokens, block) in blocks.items()])
    assert b.stats.stored == 4 and changes == [list(blocks)[1:]]
    for h, (tokens, _) in blocks.items():
        got = a.get(h, tokens)
        assert got is not None and _same(got.tensors, _block(tokens[0]))


def test_replicas_name_a_server_on_a_unix_socket_by_its_path():
    def medium(url: str) -> str:
        return RedisTier(url, LAYOUT, "f1").medium  # no connection is made until a command is sent

    assert medium("unix:///run/a.sock?db=0") == medium("unix:///run/a.sock?db=0")
    assert medium("unix:///run/a.sock?db=0") != medium("unix:///run/b.sock?db=0")
    assert medium("unix:///run/a.sock?db=0") != medium("unix:///run/a.sock?db=1")
