"""The disk tier: blocks found again by a new tier on the same directory, within its capacity, and every damaged
file a counted miss, never an error."""

import threading

import torch

from kvyard.disagg.blocks import pack_blocks
from kvyard.offload.disk_tier import DiskTier

LAYOUT = [[((4, 2, 8), torch.bfloat16), ((4, 2, 8), torch.bfloat16)] for _ in range(3)]


def _block(seed: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(shape, generator=g).to(dtype) for shape, dtype in layer] for layer in LAYOUT]


def _packed(seed: int) -> torch.Tensor:
    """The block as a tier is given it: its bytes in one row."""
    return pack_blocks(_block(seed), [0], LAYOUT[0][0][0][0])[0]


def _tier(root, capacity=1 << 20, fingerprint="f1") -> DiskTier:
    return DiskTier(root, capacity, LAYOUT, fingerprint)


def _fill(tier, n: int) -> list[bytes]:
    """Blocks 0..n-1 written (hash i repeated, tokens (i,) * 4); their hashes."""
    keys = [bytes([i]) * 32 for i in range(n)]
    for i, h in enumerate(keys):
        tier.put(h, (i,) * 4, _packed(i))
    tier.flush()
    return keys


def _record_bytes(tmp_path) -> int:
    """What one block takes on disk."""
    probe = _tier(tmp_path / "probe")
    _fill(probe, 1)
    return probe.used_bytes


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for la, lb in zip(a, b, strict=True) for x, y in zip(la, lb, strict=True))


def test_blocks_survive_a_new_tier_on_the_same_directory_only_for_the_same_fingerprint(tmp_path):
    tier = _tier(tmp_path)
    assert tier.put(b"\x01" * 32, (1, 2, 3, 4), _packed(1))
    tier.flush()
    tier.close()
    again = _tier(tmp_path)
    got = again.get(b"\x01" * 32, (1, 2, 3, 4))
    assert got is not None and _same(got.tensors, _block(1)) and again.stats.hits == 1
    assert _tier(tmp_path, fingerprint="f2").get(b"\x01" * 32, (1, 2, 3, 4)) is None


def test_the_directory_stays_within_its_capacity(tmp_path):
    size = _record_bytes(tmp_path)
    tier = _tier(tmp_path, capacity=3 * size)  # segments of a sixteenth of that: a block each
    for i in range(5):
        tier.put(bytes([i]) * 32, (i,) * 4, _packed(i))
        tier.flush()
        assert tier.used_bytes <= 3 * size and sum(p.stat().st_size for p in tier.dir.glob("*.kvs")) == tier.used_bytes
    assert len(tier) == 3 and tier.stats.evicted == 2 and len(list(tier.dir.glob("*.kvs"))) == 3
    assert tier.get(bytes([0]) * 32, (0,) * 4) is None and tier.get(bytes([4]) * 32, (4,) * 4) is not None


def test_segments_go_least_recently_used_first_whole(tmp_path):
    """Blocks share segment files; room is made a segment at a time, and a hit keeps its segment."""
    size = _record_bytes(tmp_path)
    tier = DiskTier(tmp_path, 6 * size, LAYOUT, "f1", segment_bytes=2 * size)  # two blocks a segment
    keys = _fill(tier, 6) + [bytes([i]) * 32 for i in (6, 7)]
    assert len(list(tier.dir.glob("*.kvs"))) == 3 and len(tier) == 6
    assert tier.get(keys[0], (0,) * 4) is not None  # the first segment is now the most recently used
    for i in (6, 7):
        tier.put(keys[i], (i,) * 4, _packed(i))
    tier.flush()
    assert tier.used_bytes <= 6 * size and tier.stats.evicted == 2
    assert [k in tier for k in keys] == [True, True, False, False, True, True, True, True]


def _records(tier):
    """Each block's (segment path, offset, length), as the index has them."""
    return {h: (seg.path, offset, length) for h, (seg, offset, length) in tier.index.items()}


def test_damaged_records_are_counted_misses_and_leave_the_index(tmp_path):
    tier = _tier(tmp_path)
    keys = _fill(tier, 5)
    records = _records(tier)
    path, offset, length = records[keys[1]]
    assert {p for p, _, _ in records.values()} == {path}  # one segment holds them all
    data = bytearray(path.read_bytes())
    data[offset + length - 1] ^= 0xFF  # one flipped byte in block 1: the checksum catches it
    path.write_bytes(bytes(data[: records[keys[4]][1] + length // 2]))  # and block 4 cut in half
    assert tier.get(keys[1], (1,) * 4) is None and tier.get(keys[4], (4,) * 4) is None
    assert tier.get(keys[3], (9,) * 4) is None  # other tokens under the same hash
    got = tier.get(keys[0], (0,) * 4), tier.get(keys[2], (2,) * 4)  # the records around them still read
    assert all(g is not None for g in got) and _same(got[1].tensors, _block(2))
    assert (tier.stats.corrupt, tier.stats.missing) == (3, 0) and sorted(tier.index) == [keys[0], keys[2]]
    path.unlink()  # the segment deleted behind the index's back: every block in it is a miss
    assert tier.get(keys[0], (0,) * 4) is None and tier.stats.missing == 1 and len(tier) == 0
    assert tier.used_bytes == 0


def test_a_new_tier_finds_the_whole_records_of_a_torn_segment(tmp_path):
    """A worker stopped in the middle of a write: the records before the tear are found, the rest is not."""
    tier = _tier(tmp_path)
    keys = _fill(tier, 3)
    tier.close()
    path, offset, _ = _records(tier)[keys[2]]
    path.write_bytes(path.read_bytes()[: offset + 10])
    (tier.dir / "0123.kv").write_bytes(b"a file per block, as tiers wrote before segments")
    again = _tier(tmp_path)
    assert sorted(again.index) == keys[:2] and not list(again.dir.glob("*.kv"))
    assert _same(again.get(keys[1], (1,) * 4).tensors, _block(1)) and again.get(keys[2], (2,) * 4) is None
    again.put(b"\x09" * 32, (9,) * 4, _packed(9))  # written to a segment of its own, after the torn one
    again.flush()
    assert _same(again.get(b"\x09" * 32, (9,) * 4).tensors, _block(9))


def test_a_full_queue_drops_the_write_and_counts_it(tmp_path):
    tier = DiskTier(tmp_path, 1 << 20, LAYOUT, "f", max_pending=1)
    release, writing = threading.Event(), threading.Event()
    write = tier.writer.write

    def slow_write(*args):
        writing.set()
        release.wait(10)
        write(*args)

    tier.writer.write = slow_write
    assert tier.put(b"\x00" * 32, (0,) * 4, _packed(0))
    assert writing.wait(10)  # the writer holds the first block
    assert tier.put(b"\x01" * 32, (1,) * 4, _packed(1))  # the queue's one place
    assert not tier.put(b"\x02" * 32, (2,) * 4, _packed(2))  # no room: dropped, not waited for
    # a block the tier counts as there is served while its write waits: from the queue
    queued = tier.get(b"\x01" * 32, (1,) * 4)
    assert queued is not None and _same(queued.tensors, _block(1)) and tier.get(b"\x01" * 32, (7,) * 4) is None
    release.set()
    tier.flush()
    assert (tier.stats.stored, tier.stats.dropped) == (2, 1)
    assert b"\x02" * 32 not in tier and tier.get(b"\x01" * 32, (1,) * 4) is not None


def test_a_short_write_is_finished_from_where_it_stopped(tmp_path):
    import os

    from kvyard.offload.disk_tier import _write_rest

    parts = [b"header", memoryview(bytes(range(10))), b"", b"tail"]
    whole = b"".join(parts)
    for done in range(len(whole) + 1):
        path = tmp_path / f"short-{done}"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT)
        try:
            _write_rest(fd, parts, done)
        finally:
            os.close(fd)
        assert path.read_bytes() == whole[done:]
