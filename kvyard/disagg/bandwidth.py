"""How fast KV moves from a KVSource to a KVFetcher, against what loopback TCP itself allows.

The reference is the plainest possible transfer of the same number of bytes: one sender thread, one
`sendall`, `recv_into` a preallocated buffer. A transfer does more than that (gather, a checksum on both
sides, framing, a request and an ack), so its ratio to the reference says how much the transport costs.
Every round measures the reference and each mode once, in turn, so a noisy neighbour slows all of them
alike; the figures are medians over the rounds.
"""

import os
import random
import socket
import statistics
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from kvyard.disagg import wire
from kvyard.disagg.blocks import block_index, gather_blocks, gather_layer, scatter_blocks
from kvyard.disagg.layout import KVLayout
from kvyard.disagg.zmq_transport import KVFetcher, KVSource
from kvyard.engine.block_manager import block_hashes
from kvyard.models.kv_layer import LayerKV

MODES = ("blocks", "layers", "shm", "shm-in-place")


def loopback_tcp_gbps(nbytes: int) -> float:
    """GB/s (1e9 bytes/s) of one `nbytes` transfer over a fresh loopback TCP connection, plain sockets."""
    data = memoryview(np.full(nbytes, 0x5A, dtype=np.uint8))
    sink = memoryview(np.full(nbytes, 0xA5, dtype=np.uint8))  # written once: no page faults when timed
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]

        def send() -> None:
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(data)

        sender = threading.Thread(target=send)
        start = time.perf_counter()
        sender.start()
        conn, _ = server.accept()
        with conn:
            got = 0
            while got < nbytes:
                n = conn.recv_into(sink[got:])
                if not n:
                    raise ConnectionError(f"loopback sender stopped after {got} of {nbytes} bytes")
                got += n
        elapsed = time.perf_counter() - start
        sender.join()
    return nbytes / elapsed / 1e9


def checksum_gbps(nbytes: int) -> float:
    buf = memoryview(np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8))
    start = time.perf_counter()
    wire.checksum(buf)
    return nbytes / (time.perf_counter() - start) / 1e9


def stage_ms(caches: list[LayerKV], layout: KVLayout, block_ids: list[int], repeats: int) -> dict[str, float]:
    """Each step of a transfer alone, in ms for all of `block_ids`, in warm memory (medians): the source's
    gather, one side's checksums, the fetcher's copy into its receive buffer, and the decode worker's
    scatter into its cache (after the fetch, on the engine thread: not part of the transfer's time)."""
    n = len(block_ids)
    size = wire.frame_offsets(layout.wire_nbytes(n))[1]
    staged, received = (torch.zeros(size, dtype=torch.uint8) for _ in range(2))
    index = block_index(block_ids, torch.device("cpu"))
    out = wire.frame_views(staged, layout, n)
    frames = [wire.as_bytes(t) for layer in out for t in layer]
    scratch = random_caches(layout, n)
    steps = {
        "gather": lambda: [gather_layer(c, index, layout.block_size, o) for c, o in zip(caches, out, strict=True)],
        "checksum_one_side": lambda: [wire.checksum(f) for f in frames],
        "copy_to_receive_buffer": lambda: np.copyto(received.numpy(), staged.numpy()),
        "scatter_into_cache": lambda: scatter_blocks(scratch, list(range(n)), layout.block_size, out),
    }
    return {name: 1000 * _median_s(step, repeats) for name, step in steps.items()}


def _median_s(step: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):  # the first run faults the pages in
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def random_caches(layout: KVLayout, num_blocks: int) -> list[LayerKV]:
    slots = num_blocks * layout.block_size
    caches = [LayerKV.allocate(slots, layout.num_kv_heads, layout.head_dim, layout.torch_dtype,
                               torch.device("cpu"), int8=layout.quantized) for _ in range(layout.num_layers)]
    for cache in caches:
        for t in (cache.k, cache.v, cache.k_scale, cache.v_scale):
            if t is None:
                continue
            if t.is_floating_point():
                t.normal_()
            else:
                t.random_(-127, 128)
    return caches


class _Mode:
    """One mode's source and fetcher, kept across rounds."""

    def __init__(self, mode: str, caches: list[LayerKV], block_size: int):
        self.mode, self.block_size = mode, block_size
        shm = mode.startswith("shm")
        self.source = KVSource(caches, block_size, mode="layers" if mode == "layers" else "blocks", allow_shm=shm)
        self.fetcher = KVFetcher(allow_shm=shm)
        self.in_place = mode == "shm-in-place"  # views of the segment, no checksums: what a decode worker does
        self.seconds: list[float] = []

    def transfer(self, layout: KVLayout, block_ids: list[int], round_no: int, check: bool) -> None:
        tokens = [random.randrange(50_000) for _ in range(len(block_ids) * self.block_size)]
        hashes = block_hashes(tokens, self.block_size)
        tid = f"bench-{self.mode}-{round_no}"
        self.source.offer(tid, block_ids, hashes, tokens, lambda: None, timeout_s=60.0)
        start = time.perf_counter()
        payload = self.fetcher.fetch(self.source.endpoint, tid, layout, hashes, timeout_s=60.0,
                                     in_place=self.in_place)
        self.seconds.append(time.perf_counter() - start)
        if check:
            want = gather_blocks(self.source.caches, block_ids, self.block_size)
            if not all(torch.equal(a, b) for wl, gl in zip(want, payload.tensors, strict=True)
                       for a, b in zip(wl, gl, strict=True)):
                raise AssertionError(f"{self.mode}: the fetched KV differs from the source's")
        payload.finish()  # in place: the ack (a copied payload was acknowledged before fetch returned)
        deadline = time.monotonic() + 5.0
        while self.source.num_held and time.monotonic() < deadline:  # the segment back in the pool for the next
            time.sleep(0.001)

    def close(self) -> None:
        self.source.close()
        self.fetcher.close()


def run_transfer_bench(layout: KVLayout, num_tokens: int, repeats: int,
                       modes: tuple[str, ...] = MODES) -> dict:
    """Loopback TCP and each mode's transfer of `num_tokens` tokens of KV, `repeats` rounds after a warm-up."""
    num_blocks = -(-num_tokens // layout.block_size)
    caches = random_caches(layout, 2 * num_blocks)  # transfers take scattered blocks out of a larger pool
    runs = [_Mode(m, caches, layout.block_size) for m in modes]
    loopback: list[float] = []
    nbytes = num_blocks * layout.block_nbytes()
    try:
        for r in range(repeats + 1):
            block_ids = random.sample(range(2 * num_blocks), num_blocks)
            gbps = loopback_tcp_gbps(nbytes)
            for run in runs:
                run.transfer(layout, block_ids, r, check=r == 0)
            if r == 0:  # warm-up: first connections, page faults, the shm resource tracker
                for run in runs:
                    run.seconds.clear()
            else:
                loopback.append(gbps)
    finally:
        for run in runs:
            run.close()
    ref = statistics.median(loopback)
    speed = checksum_gbps(min(nbytes, 64 << 20))
    result: dict = {
        "layout": {f: getattr(layout, f) for f in layout.__struct_fields__},
        "tokens": num_blocks * layout.block_size, "blocks": num_blocks, "bytes": nbytes, "repeats": repeats,
        "cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0],  # how noisy the machine was
        "loopback_tcp_gbps": ref,
        "checksum_gbps": speed, "checksum_ms_per_side": 1000 * nbytes / speed / 1e9,
        "stages_ms": stage_ms(caches, layout, block_ids, repeats),  # where a transfer's time goes
        "modes": {},
    }
    for run in runs:
        s = statistics.median(run.seconds)
        result["modes"][run.mode] = {"gbps": nbytes / s / 1e9, "ratio_to_loopback": nbytes / s / 1e9 / ref,
                                     "ms_per_transfer": 1000 * s}
    return result
