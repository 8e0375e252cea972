"""Reused memory: the source's shared-memory segments and staging, the fetcher's receive buffers."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import zmq

from kvyard.disagg import shm as shm_module
from kvyard.disagg import wire
from kvyard.disagg.layout import KVLayout
from kvyard.disagg.payload import KVIntegrityError
from kvyard.disagg.shm_pool import GRANULE, SegmentPool
from kvyard.disagg.warm_buffers import WarmBuffers
from kvyard.disagg.zmq_transport import KVFetcher, KVSource
from tests.disagg.conftest import BLOCK, NUM_BLOCKS, Offer, make_caches, segments
from tests.disagg.test_transport import assert_same_kv, flip_first_byte, open_pair

ROOT = Path(__file__).resolve().parents[2]


def test_pool_reuses_a_released_segment_and_rounds_sizes_up():
    pool = SegmentPool()
    a = pool.acquire(1000)
    assert a.size == GRANULE and pool.created == 1
    pool.release(a)
    assert pool.acquire(GRANULE) is a and pool.created == 1
    pool.release(a)
    pool.close()
    assert segments() == []


def test_pool_never_hands_out_a_segment_in_use():
    pool = SegmentPool()
    a = pool.acquire(1000)
    b = pool.acquire(1000)
    assert b is not a and pool.created == 2
    pool.release(a)
    pool.release(b)
    again = [pool.acquire(10), pool.acquire(10)]
    assert {s.name for s in again} == {a.name, b.name} and pool.created == 2
    for seg in again:
        pool.release(seg)
    pool.close()
    assert segments() == []


def test_pool_takes_the_smallest_fit_and_grows_on_demand():
    pool = SegmentPool()
    small, big = pool.acquire(GRANULE), pool.acquire(3 * GRANULE)
    pool.release(big)
    pool.release(small)
    assert pool.acquire(GRANULE - 5) is small
    assert pool.acquire(GRANULE + 1) is big
    bigger = pool.acquire(5 * GRANULE)  # nothing idle fits: a new one
    assert bigger.size == 5 * GRANULE and pool.created == 3
    for seg in (small, big, bigger):
        pool.release(seg)
    pool.close()
    assert segments() == []


def test_pool_unlinks_beyond_its_idle_limit_and_after_close():
    pool = SegmentPool(max_idle_bytes=GRANULE)
    a, b = pool.acquire(1), pool.acquire(1)
    pool.release(a)
    pool.release(b)  # over the limit: unlinked at once
    assert pool.num_idle == 1 and len(segments()) == 1
    c = pool.acquire(1)
    pool.close()
    assert segments() == [seg for seg in segments() if c.name in seg]  # only the one in use is left
    pool.release(c)  # released after close: unlinked, not kept
    assert segments() == [] and pool.num_idle == 0


def test_a_segment_is_reused_after_the_ack_with_bit_exact_data(caches, layout, shm_fetcher):
    with KVSource(caches, BLOCK) as source:
        first = Offer("a", [9, 3, 14], seed=1).offer_to(source)
        assert_same_kv(caches, first.block_ids, shm_fetcher.fetch(source.endpoint, "a", layout, first.hashes, 5))
        name = segments()
        second = Offer("b", [2, 7, 0], seed=2).offer_to(source)
        assert_same_kv(caches, second.block_ids, shm_fetcher.fetch(source.endpoint, "b", layout, second.hashes, 5))
        assert segments() == name and source.segment_pool.created == 1 and source.stats.served_shm == 2
    assert segments() == []


def test_a_held_segment_is_not_reused(caches, layout, shm_fetcher):
    """A fetcher that took the reply but has not acked yet: the next transfer gets another segment."""
    with KVSource(caches, BLOCK) as source, zmq.Context() as ctx:
        slow = Offer("slow", [1, 2], seed=1).offer_to(source)
        sock = ctx.socket(zmq.DEALER)
        sock.connect(source.endpoint)
        sock.send(wire.encode(wire.Fetch("slow", layout, wire.host_id(), shm=True, lease_s=30)))
        assert sock.poll(5000)
        held_name = wire.decode_reply(sock.recv()).shm_name
        for _ in range(layout.num_layers):  # the segment is complete once every layer is announced
            assert sock.poll(5000)
            sock.recv()
        held_bytes = shm_module.read(held_name, 1 << 20).copy()
        fast = Offer("fast", [5, 6], seed=2).offer_to(source)
        assert_same_kv(caches, fast.block_ids, shm_fetcher.fetch(source.endpoint, "fast", layout, fast.hashes, 5))
        assert source.segment_pool.created == 2 and slow.released.count == 0
        assert (shm_module.read(held_name, 1 << 20) == held_bytes).all()  # untouched by the other transfer
        sock.close(linger=0)
    assert slow.released.count == 1 and segments() == []


def test_corruption_is_still_detected_in_a_reused_segment(caches, layout, shm_fetcher):
    with KVSource(caches, BLOCK) as source:
        ok = Offer("ok", [1, 2]).offer_to(source)
        shm_fetcher.fetch(source.endpoint, "ok", layout, ok.hashes, 5)
        source._tamper = flip_first_byte
        bad = Offer("bad", [3, 4], seed=1).offer_to(source)
        with pytest.raises(KVIntegrityError, match=r"layer \d v fails its checksum"):
            shm_fetcher.fetch(source.endpoint, "bad", layout, bad.hashes, 5)
        assert source.segment_pool.created == 1 and bad.released.count == 1


def test_a_short_reused_segment_is_refused(caches, layout, shm_fetcher, monkeypatch):
    with KVSource(caches, BLOCK) as source:
        ok = Offer("ok", [1, 2]).offer_to(source)
        shm_fetcher.fetch(source.endpoint, "ok", layout, ok.hashes, 5)
        real_read = shm_module.read
        monkeypatch.setattr(shm_module, "read", lambda name, size: real_read(name, size)[: size - 100])
        short = Offer("short", [3, 4], seed=1).offer_to(source)
        with pytest.raises(KVIntegrityError, match="short transfer"):
            shm_fetcher.fetch(source.endpoint, "short", layout, short.hashes, 5)
        assert source.segment_pool.created == 1


@pytest.mark.parametrize("path", ["layers", "shm"])
def test_a_kept_payload_is_not_overwritten_by_the_next_fetch(caches, layout, path):
    """The fetcher reuses a receive buffer only once no tensor of an earlier payload is alive."""
    source, fetcher = open_pair(caches, path)
    with source, fetcher:
        first = Offer("a", [9, 3], seed=1).offer_to(source)
        kept = fetcher.fetch(source.endpoint, "a", layout, first.hashes, 5).tensors[0][1][2:BLOCK]  # a view
        second = Offer("b", [4, 5], seed=2).offer_to(source)
        fetcher.fetch(source.endpoint, "b", layout, second.hashes, 5)  # dropped at once
        assert fetcher.buffers.allocated == 2
        assert torch.equal(kept.view(torch.uint8), caches[0].v[9 * BLOCK + 2 : 10 * BLOCK].view(torch.uint8))
        del kept
        third = Offer("c", [6, 7], seed=3).offer_to(source)
        assert_same_kv(caches, third.block_ids, fetcher.fetch(source.endpoint, "c", layout, third.hashes, 5))
        assert fetcher.buffers.allocated == 2


def test_tcp_replies_are_gathered_into_reused_staging_memory(caches, layout):
    source, fetcher = open_pair(caches, "blocks")
    with source, fetcher:
        for i, blocks in enumerate([[1, 2], [3, 4], [5, 6]]):
            offer = Offer(f"t{i}", blocks, seed=i).offer_to(source)
            assert_same_kv(caches, blocks, fetcher.fetch(source.endpoint, offer.tid, layout, offer.hashes, 5))
        assert source.buffers.allocated == 1  # zmq let go of each reply before the next one was gathered


def test_receive_buffers_are_reused_once_unused():
    buffers = WarmBuffers()
    view = torch.from_numpy(buffers.take(100)[10:20]).view(torch.int16)
    other = buffers.take(100)
    assert buffers.allocated == 2
    del view, other
    buffers.take(50)
    assert buffers.allocated == 2 and buffers.num_kept == 2


def test_a_buffer_queued_in_a_zmq_frame_is_not_reused():
    buffers = WarmBuffers()
    frame = zmq.Frame(memoryview(buffers.take(1 << 20)), copy=False)  # as the source sends a staged reply
    buffers.take(1 << 20)
    assert buffers.allocated == 2
    del frame
    buffers.take(1 << 20)
    assert buffers.allocated == 2


@pytest.mark.parametrize("path", ["blocks", "layers", "shm"])
def test_back_to_back_large_transfers_stay_bit_exact(path):
    """Frames over pyzmq's zero-copy threshold (64 KiB), every payload kept until the end."""
    caches = make_caches(heads=8, dim=64, num_blocks=64)
    layout = KVLayout.of(caches, BLOCK)
    source, fetcher = open_pair(caches, path)
    with source, fetcher:
        got = []
        for i in range(4):
            offer = Offer(f"t{i}", list(range(i, 64, 3))[:20], seed=i).offer_to(source)
            got.append((offer.block_ids, fetcher.fetch(source.endpoint, offer.tid, layout, offer.hashes, 10)))
        for block_ids, payload in got:
            assert_same_kv(caches, block_ids, payload)


def test_idle_segments_are_unlinked_at_interpreter_exit():
    code = ("from kvyard.disagg.shm_pool import SegmentPool\n"
            "pool = SegmentPool()\nseg = pool.acquire(10)\npool.release(seg)\nprint(seg.name)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert not os.path.exists(os.path.join(shm_module.SHM_DIR, done.stdout.strip()))
    assert "leaked" not in done.stderr  # unlinked by the pool, not by the resource tracker


def test_an_in_place_payload_reads_the_segment_and_holds_it_until_finish(caches, layout, shm_fetcher):
    """in_place: views of the source's segment, checked, acknowledged only by finish(); meanwhile the next
    transfer gets another segment, so the views keep their bytes."""
    with KVSource(caches, BLOCK) as source:
        first = Offer("a", [9, 3, 14], seed=1).offer_to(source)
        payload = shm_fetcher.fetch(source.endpoint, "a", layout, first.hashes, 5, in_place=True)
        assert payload.in_place and payload.valid_until > time.monotonic()
        assert shm_fetcher.buffers.allocated == 0  # nothing was copied into a receive buffer
        assert_same_kv(caches, first.block_ids, payload)
        assert source.num_held == 1 and first.released.count == 0
        second = Offer("b", [2, 7, 0], seed=2).offer_to(source)
        shm_fetcher.fetch(source.endpoint, "b", layout, second.hashes, 5)  # copied, acked at once
        assert source.segment_pool.created == 2 and second.released.count == 1
        assert_same_kv(caches, first.block_ids, payload)  # untouched by the other transfer
        payload.finish()
        payload.finish()  # idempotent
        assert first.released.event.wait(5) and first.released.count == 1
        assert source.stats.released_by_ack == 2 and source.num_held == 0


def test_an_in_place_payload_reports_its_problem(caches, layout, shm_fetcher):
    with KVSource(caches, BLOCK) as source:
        offer = Offer("a", [1, 2]).offer_to(source)
        shm_fetcher.fetch(source.endpoint, "a", layout, offer.hashes, 5, in_place=True).finish("lease ran out")
        assert offer.released.event.wait(5) and source.stats.released_by_reject == 1


def test_in_place_over_tcp_is_an_ordinary_copy(caches, layout):
    with KVSource(caches, BLOCK, mode="layers") as source, KVFetcher(allow_shm=False) as fetcher:
        offer = Offer("a", [1, 2]).offer_to(source)
        payload = fetcher.fetch(source.endpoint, "a", layout, offer.hashes, 5, in_place=True)
        assert not payload.in_place and offer.released.count == 1  # acked before fetch returned
        payload.finish()  # a no-op
        assert_same_kv(caches, offer.block_ids, payload) and source.stats.released_by_ack == 1


def test_a_warmed_segment_serves_the_first_transfer(caches, layout, shm_fetcher):
    with KVSource(caches, BLOCK) as source:
        assert source.warm_shm(NUM_BLOCKS) and source.segment_pool.created == 1
        offer = Offer("a", [9, 3, 14]).offer_to(source)
        assert_same_kv(caches, offer.block_ids, shm_fetcher.fetch(source.endpoint, "a", layout, offer.hashes, 5))
        assert source.segment_pool.created == 1  # the warmed one, reused
        assert not source.segment_pool.warm(source.segment_pool.max_idle_bytes + 1)  # the pool would not keep it


@pytest.mark.parametrize("confirm", [True, False])
def test_a_release_is_confirmed_only_when_asked(caches, confirm):
    """An in-place ack comes from a socket that closes right after sending: it asks for no Released."""
    with KVSource(caches, BLOCK) as source, zmq.Context() as ctx:
        offer = Offer("a", [1, 2]).offer_to(source)
        sock = ctx.socket(zmq.DEALER)
        sock.connect(source.endpoint)
        sock.send(wire.encode(wire.Release("a", confirm=confirm)))
        assert offer.released.event.wait(5)
        assert bool(sock.poll(500)) == confirm
        sock.close(linger=0)
