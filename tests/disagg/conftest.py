import glob
import os
import threading
import time

import pytest
import torch

from kvyard.disagg.layout import KVLayout
from kvyard.disagg.zmq_transport import KVFetcher
from kvyard.engine.block_manager import block_hashes
from kvyard.models.kv_layer import LayerKV

BLOCK = 4
NUM_BLOCKS = 16


def make_caches(dtype: torch.dtype = torch.bfloat16, int8: bool = False, layers: int = 3, heads: int = 2,
                dim: int = 8, num_blocks: int = NUM_BLOCKS) -> list[LayerKV]:
    g = torch.Generator().manual_seed(0)
    caches = [LayerKV.allocate(num_blocks * BLOCK, heads, dim, dtype, torch.device("cpu"), int8=int8)
              for _ in range(layers)]
    for c in caches:
        for t in (c.k, c.v, c.k_scale, c.v_scale):
            if t is None:
                continue
            if t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=g))
            else:
                t.copy_(torch.randint(-127, 128, t.shape, generator=g))
    return caches


class Releases:
    """An on_release callback that records when it was called."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.event = threading.Event()

    def __call__(self) -> None:
        self.times.append(time.monotonic())
        self.event.set()

    @property
    def count(self) -> int:
        return len(self.times)


class Offer:
    """A transfer's tokens, hashes and release record, for `source.offer`."""

    def __init__(self, tid: str, block_ids: list[int], seed: int = 0):
        self.tid, self.block_ids = tid, block_ids
        self.tokens = [(seed * 1000 + i) % 997 for i in range(len(block_ids) * BLOCK)]
        self.hashes = block_hashes(self.tokens, BLOCK)
        self.released = Releases()

    def offer_to(self, source, timeout_s: float = 10.0) -> "Offer":
        source.offer(self.tid, self.block_ids, self.hashes, self.tokens, self.released, timeout_s)
        return self


def wait_until(cond, timeout_s: float = 5.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def segments() -> list[str]:
    return glob.glob(f"/dev/shm/kvyard-kv-{os.getpid()}-*")


@pytest.fixture
def caches() -> list[LayerKV]:
    return make_caches()


@pytest.fixture
def layout(caches) -> KVLayout:
    return KVLayout.of(caches, BLOCK)


@pytest.fixture
def shm_fetcher():
    f = KVFetcher()
    assert f.allow_shm, "this host has no /dev/shm or boot id"
    yield f
    f.close()
