import threading
import time

import msgspec
import pytest
import torch
import zmq

from kvyard.disagg import shm as shm_module
from kvyard.disagg import wire
from kvyard.disagg.blocks import gather_blocks
from kvyard.disagg.layout import KVLayout
from kvyard.disagg.payload import KVIntegrityError, KVTransferError
from kvyard.disagg.zmq_transport import KVFetcher, KVSource
from tests.disagg.conftest import BLOCK, Offer, make_caches, segments, wait_until

# (source mode, fetcher accepts shared memory)
PATHS = {"blocks": ("blocks", False), "layers": ("layers", False), "shm": ("blocks", True)}


@pytest.fixture
def fetcher():
    f = KVFetcher(allow_shm=False)
    yield f
    f.close()


def open_pair(caches, path: str) -> tuple[KVSource, KVFetcher]:
    mode, use_shm = PATHS[path]
    return KVSource(caches, BLOCK, mode=mode), KVFetcher(allow_shm=use_shm)


def assert_same_kv(caches, block_ids, payload) -> None:
    want = gather_blocks(caches, block_ids, BLOCK)
    assert len(payload.tensors) == len(want)
    for w, g in zip(want, payload.tensors, strict=True):
        assert len(w) == len(g)
        for a, b in zip(w, g, strict=True):
            assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("int8", [False, True], ids=["bf16", "int8"])
def test_transfer_is_bit_exact_and_released_by_ack(path, int8):
    caches = make_caches(torch.bfloat16, int8)
    layout = KVLayout.of(caches, BLOCK)
    source, fetcher = open_pair(caches, path)
    with source, fetcher:
        offer = Offer("t1", [9, 3, 14]).offer_to(source)
        payload = fetcher.fetch(source.endpoint, "t1", layout, offer.hashes, timeout_s=10)
        assert_same_kv(caches, offer.block_ids, payload)
        assert payload.token_ids == offer.tokens and payload.block_hashes == offer.hashes
        assert payload.nbytes == 3 * layout.block_nbytes()
        assert offer.released.count == 1  # before fetch returned: the source confirmed the release
        assert source.stats.released_by_ack == 1 and source.stats.served_shm == (path == "shm")
        assert source.num_held == 0 and source.segment_pool.num_idle == len(segments()) == (path == "shm")
    assert offer.released.count == 1  # close does not release it again
    assert segments() == []  # the pooled segment is unlinked on close


def test_fetcher_is_thread_safe(caches, layout, fetcher):
    with KVSource(caches, BLOCK, mode="layers") as source:
        offers = [Offer(f"t{i}", [i, i + 8], seed=i).offer_to(source) for i in range(6)]
        errors: list[BaseException] = []

        def pull(o: Offer) -> None:
            try:
                assert_same_kv(caches, o.block_ids, fetcher.fetch(source.endpoint, o.tid, layout, o.hashes, 10))
            except BaseException as e:  # noqa: BLE001 (reported below)
                errors.append(e)

        threads = [threading.Thread(target=pull, args=(o,)) for o in offers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == [] and [o.released.count for o in offers] == [1] * 6


def test_layout_mismatch_is_refused_with_the_differences(caches, fetcher):
    other = KVLayout(3, 2, 8, BLOCK, "float32", False)
    with KVSource(caches, BLOCK) as source:
        offer = Offer("t", [1]).offer_to(source)
        with pytest.raises(KVIntegrityError, match="layout mismatch: dtype: expected 'float32', got 'bfloat16'"):
            fetcher.fetch(source.endpoint, "t", other, offer.hashes, timeout_s=5)
        assert offer.released.count == 1 and source.stats.released_by_reject == 1


@pytest.mark.parametrize("path", ["blocks", "layers"])
def test_wrong_hashes_are_refused_and_released(caches, layout, path):
    source, fetcher = open_pair(caches, path)
    with source, fetcher:
        offer = Offer("t", [1, 2]).offer_to(source)
        other = Offer("u", [1, 2], seed=3)
        with pytest.raises(KVIntegrityError, match="block 0 hash .* differs"):
            fetcher.fetch(source.endpoint, "t", layout, other.hashes, timeout_s=5)
        assert offer.released.count == 1 and source.stats.released_by_reject == 1


def flip_first_byte(frames: list[memoryview]) -> list[memoryview]:
    frames[-1][0] = frames[-1][0] ^ 0xFF  # the gathered copy (or the segment), never the cache
    return frames


@pytest.mark.parametrize("path", list(PATHS))
def test_a_corrupt_frame_is_refused(caches, layout, path):
    source, fetcher = open_pair(caches, path)
    source._tamper = flip_first_byte
    with source, fetcher:
        offer = Offer("t", [4, 5]).offer_to(source)
        with pytest.raises(KVIntegrityError, match=r"layer \d v fails its checksum"):
            fetcher.fetch(source.endpoint, "t", layout, offer.hashes, timeout_s=5)
        assert offer.released.count == 1 and source.stats.released_by_reject == 1
    assert segments() == []


@pytest.mark.parametrize("path", ["blocks", "layers"])
def test_a_missing_frame_is_refused(caches, layout, path):
    source, fetcher = open_pair(caches, path)
    source._tamper = lambda frames: frames[:-1]
    with source, fetcher:
        offer = Offer("t", [4, 5]).offer_to(source)
        with pytest.raises(KVIntegrityError, match="short or padded transfer"):
            fetcher.fetch(source.endpoint, "t", layout, offer.hashes, timeout_s=5)


def test_a_short_segment_is_refused(caches, layout, shm_fetcher, monkeypatch):
    real_read = shm_module.read
    monkeypatch.setattr(shm_module, "read", lambda name, size: real_read(name, size)[: size - 100])
    with KVSource(caches, BLOCK) as source:
        offer = Offer("t", [4, 5]).offer_to(source)
        with pytest.raises(KVIntegrityError, match="short transfer"):
            shm_fetcher.fetch(source.endpoint, "t", layout, offer.hashes, timeout_s=5)


def test_unknown_and_released_transfer_ids(caches, layout, fetcher):
    with KVSource(caches, BLOCK) as source:
        with pytest.raises(KVTransferError, match="unknown transfer id 'nope' \\(never offered here\\)"):
            fetcher.fetch(source.endpoint, "nope", layout, [], timeout_s=5)
        offer = Offer("t", [1]).offer_to(source)
        fetcher.fetch(source.endpoint, "t", layout, offer.hashes, timeout_s=5)
        with pytest.raises(KVTransferError, match="released by ack"):
            fetcher.fetch(source.endpoint, "t", layout, offer.hashes, timeout_s=5)
        assert source.stats.refused == 2


def test_release_by_timeout_is_called_once(caches, layout, fetcher):
    with KVSource(caches, BLOCK) as source:
        offer = Offer("t", [1]).offer_to(source, timeout_s=0.1)
        start = time.monotonic()
        assert offer.released.event.wait(3)
        assert 0.09 <= offer.released.times[0] - start < 1.0
        time.sleep(0.2)
        assert offer.released.count == 1 and source.stats.released_by_timeout == 1 and source.num_held == 0
        with pytest.raises(KVTransferError, match="released by timeout"):
            fetcher.fetch(source.endpoint, "t", layout, offer.hashes, timeout_s=5)


def test_a_timeout_during_a_read_waits_for_the_read(caches, layout, fetcher):
    read_end: list[float] = []

    def slow(frames):
        time.sleep(0.4)  # the offer's 0.1 s timeout passes while the source is reading the blocks
        read_end.append(time.monotonic())
        return frames

    with KVSource(caches, BLOCK) as source:
        source._tamper = slow
        offer = Offer("t", [1, 2]).offer_to(source, timeout_s=0.1)
        payload = fetcher.fetch(source.endpoint, "t", layout, offer.hashes, timeout_s=5)
        assert_same_kv(caches, offer.block_ids, payload)
        assert wait_until(lambda: offer.released.count == 1)
        assert offer.released.times[0] >= read_end[0]
        time.sleep(0.1)
        assert offer.released.count == 1


def test_a_timeout_during_a_segment_copy_waits_for_the_copy(caches, layout, shm_fetcher, monkeypatch):
    real_read = shm_module.read

    def slow_read(name, size):
        time.sleep(0.4)  # the offer's timeout passes; the segment must still be there
        return real_read(name, size)

    monkeypatch.setattr(shm_module, "read", slow_read)
    with KVSource(caches, BLOCK) as source:
        offer = Offer("t", [1, 2]).offer_to(source, timeout_s=0.1)
        payload = shm_fetcher.fetch(source.endpoint, "t", layout, offer.hashes, timeout_s=5)
        assert_same_kv(caches, offer.block_ids, payload)
        assert offer.released.count == 1 and source.stats.released_by_ack == 1
        assert source.stats.served_shm == 1 and source.segment_pool.num_idle == 1
    assert segments() == []


def test_a_segment_is_returned_when_its_fetcher_dies(caches, layout):
    """A fetcher that takes the shared-memory reply and vanishes: the segment goes back to the pool on
    timeout, and is unlinked on close."""
    with KVSource(caches, BLOCK) as source, zmq.Context() as ctx:
        offer = Offer("t", [1, 2]).offer_to(source, timeout_s=0.1)
        sock = ctx.socket(zmq.DEALER)
        sock.connect(source.endpoint)
        sock.send(wire.encode(wire.Fetch("t", layout, wire.host_id(), shm=True, lease_s=0.3)))
        assert sock.poll(5000)
        header = wire.decode_reply(sock.recv())
        assert isinstance(header, wire.Header) and header.mode == "shm"
        assert len(segments()) == 1
        sock.close(linger=0)
        assert offer.released.event.wait(3)
        assert source.segment_pool.num_idle == 1 and source.stats.released_by_timeout == 1
    assert segments() == []


def test_close_releases_what_is_held_and_refuses_new_offers(caches):
    source = KVSource(caches, BLOCK)
    offers = [Offer(f"t{i}", [i]).offer_to(source) for i in range(3)]
    source.close()
    assert [o.released.count for o in offers] == [1, 1, 1] and source.stats.released_on_close == 3
    with pytest.raises(KVTransferError, match="closed"):
        Offer("late", [1]).offer_to(source)


def test_a_failing_callback_does_not_stop_the_source(caches, layout, fetcher):
    with KVSource(caches, BLOCK) as source:
        source.offer("bad", [1], Offer("x", [1]).hashes, Offer("x", [1]).tokens, lambda: 1 / 0, 0.05)
        assert wait_until(lambda: source.stats.callback_errors == 1)
        offer = Offer("t", [2]).offer_to(source)
        fetcher.fetch(source.endpoint, "t", layout, offer.hashes, timeout_s=5)
        assert offer.released.count == 1


def test_offer_validates_its_arguments(caches):
    with KVSource(caches, BLOCK) as source:
        o = Offer("t", [1, 2])
        with pytest.raises(ValueError, match="2 blocks, 1 hashes"):
            source.offer("t", o.block_ids, o.hashes[:1], o.tokens, o.released, 1)
        with pytest.raises(ValueError, match="outside"):
            source.offer("t", [1, 99], o.hashes, o.tokens, o.released, 1)
        o.offer_to(source)
        with pytest.raises(ValueError, match="already offered"):
            o.offer_to(source)
        with pytest.raises(ValueError, match="mode"):
            KVSource(caches, BLOCK, mode="bytes")


def test_an_unreachable_source_fails_within_the_timeout(layout, fetcher):
    with zmq.Context() as ctx:  # a free port: bind, note it, close
        s = ctx.socket(zmq.ROUTER)
        port = s.bind_to_random_port("tcp://127.0.0.1")
        s.close(linger=0)
    start = time.monotonic()
    with pytest.raises(KVTransferError, match="timed out after 0.3 s waiting for a reply"):
        fetcher.fetch(f"tcp://127.0.0.1:{port}", "t", layout, [], timeout_s=0.3)
    assert time.monotonic() - start < 2


def test_a_silent_source_fails_within_the_timeout(layout, fetcher):
    with zmq.Context() as ctx:
        router = ctx.socket(zmq.ROUTER)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        start = time.monotonic()
        with pytest.raises(KVTransferError, match="unreachable, dead or stalled"):
            fetcher.fetch(f"tcp://127.0.0.1:{port}", "t", layout, [], timeout_s=0.3)
        assert time.monotonic() - start < 2
        router.close(linger=0)


def test_a_source_that_disconnects_mid_transfer_fails_fast(caches, layout, fetcher):
    """Header sent, then the source goes away: KVTransferError at once, not after the 20 s timeout."""
    offer = Offer("t", [1, 2])
    with zmq.Context() as ctx:
        router = ctx.socket(zmq.ROUTER)
        port = router.bind_to_random_port("tcp://127.0.0.1")

        def half_serve() -> None:
            peer, _ = router.recv_multipart()
            nbytes = layout.frame_nbytes(2) * layout.num_layers
            header = wire.Header("t", "layers", layout, offer.hashes, offer.tokens, nbytes, [])
            router.send_multipart([peer, wire.encode(header)])
            time.sleep(0.2)
            router.close(linger=0)

        server = threading.Thread(target=half_serve)
        server.start()
        start = time.monotonic()
        with pytest.raises(KVTransferError, match="disconnected while waiting for layer 0 of 3"):
            fetcher.fetch(f"tcp://127.0.0.1:{port}", "t", layout, offer.hashes, timeout_s=20)
        assert time.monotonic() - start < 5
        server.join()


def test_an_invisible_segment_falls_back_to_tcp(caches, layout, shm_fetcher, monkeypatch):
    monkeypatch.setattr(shm_module, "read", lambda name, size: None)  # e.g. another /dev/shm namespace
    with KVSource(caches, BLOCK) as source:
        offer = Offer("t", [3, 1]).offer_to(source)
        assert_same_kv(caches, offer.block_ids, shm_fetcher.fetch(source.endpoint, "t", layout, offer.hashes, 5))
        assert source.stats.served == 2 and source.stats.served_shm == 1 and source.num_held == 0
    assert segments() == []


def test_no_shared_memory_on_the_source_falls_back_to_tcp(caches, layout, shm_fetcher, monkeypatch):
    def full(size):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shm_module, "create", full)
    with KVSource(caches, BLOCK) as source:
        offer = Offer("t", [3, 1]).offer_to(source)
        assert_same_kv(caches, offer.block_ids, shm_fetcher.fetch(source.endpoint, "t", layout, offer.hashes, 5))
        assert source.stats.served == 1 and source.stats.served_shm == 0


@pytest.mark.parametrize("field,value,match", [
    ("layout", KVLayout(3, 2, 8, BLOCK, "float16", False), "layout mismatch: dtype: expected 'bfloat16', got 'float16'"),
    ("transfer_id", "other", "asked for transfer t, got other"),
    ("frame_nbytes", [64] * 6, "frame sizes do not match the layout"),
])
def test_the_fetcher_checks_the_header_itself(layout, fetcher, field, value, match):
    """A source that skips its own checks (another version, a bug) still cannot hand over wrong KV."""
    offer = Offer("t", [1, 2])
    header = wire.Header("t", "blocks", layout, offer.hashes, offer.tokens, layout.frame_nbytes(2) * 3, [0] * 6)
    with zmq.Context() as ctx:
        router = ctx.socket(zmq.ROUTER)
        port = router.bind_to_random_port("tcp://127.0.0.1")

        def answer() -> None:
            peer, _ = router.recv_multipart()
            router.send_multipart([peer, wire.encode(msgspec.structs.replace(header, **{field: value}))])
            router.poll(2000)  # the fetcher's rejection
            router.close(linger=0)

        server = threading.Thread(target=answer)
        server.start()
        with pytest.raises(KVIntegrityError, match=match):
            fetcher.fetch(f"tcp://127.0.0.1:{port}", "t", layout, offer.hashes, timeout_s=5)
        server.join()
