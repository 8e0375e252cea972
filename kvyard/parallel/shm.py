"""Collectives through shared memory, for ranks on one host (vLLM's CPU backend does the same in C++).

Gloo moves every all-reduce through loopback TCP and its own threads; for the small tensors of a decode step
(batch x hidden) the latency of that path, not the bytes, is the cost. Here the ranks map one segment in
/dev/shm instead: each writes its tensor into its own slot, raises its counter, waits for the others' counters,
and sums the slots in rank order, so every rank ends with the same bits.

The segment holds two buffers that collectives use in turn: a rank may write collective s into buffer s % 2
once every rank has finished reading collective s - 2 from it, so no rank waits twice per collective. A tensor
larger than a slot goes through in slot-sized chunks, each a collective of its own.

The counters are plain int64 stores and loads: on x86 (total store order) a rank that sees another's counter
raised also sees the data written before it. A wait gives up with an error when a peer process is gone or the
group's timeout passes, so nothing hangs on a dead rank.
"""

import mmap
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from kvyard.errors import KvyardError
from kvyard.parallel.comm import DEFAULT_TIMEOUT_S, GlooGroup

SLOT_BYTES = 4 << 20  # per rank and buffer: a decode step's all-reduce is batch x hidden, far smaller
_HEADER_STRIDE = 8  # int64s per rank (one 64-byte cache line, so ranks' counters share none)
_WRITTEN, _DONE, _PID = 0, 1, 2
_SPINS_BEFORE_YIELD = 2000  # then give the core (and the GIL) away between looks: ranks may outnumber cores
_CHECK_EVERY = 1024  # looks between checks of the clock and the peers


class PeerLostError(KvyardError):
    """A collective could not finish: a peer rank is gone or did not arrive in time."""


class SharedMemoryGroup(GlooGroup):
    """A GlooGroup (for setting up, and across hosts) whose collectives go through a shared segment."""

    def __init__(self, rank: int, size: int, master: str = "127.0.0.1:29531", timeout_s: float = DEFAULT_TIMEOUT_S,
                 slot_bytes: int = SLOT_BYTES, driven: bool = False):
        super().__init__(rank, size, master, timeout_s, driven)
        self.timeout_s = timeout_s
        self.slot_bytes = slot_bytes
        header_bytes = size * _HEADER_STRIDE * 8
        self._data_offset = -(-header_bytes // 4096) * 4096
        self._mm = self._map_segment(self._data_offset + 2 * size * slot_bytes)
        self._header = np.frombuffer(self._mm, dtype=np.int64, count=size * _HEADER_STRIDE).reshape(size, -1)
        data = torch.frombuffer(self._mm, dtype=torch.uint8, offset=self._data_offset, count=2 * size * slot_bytes)
        self._slots = data.view(2, size, slot_bytes)
        self._header[rank, _PID] = os.getpid()
        self._seq = 0
        dist.barrier()  # every rank's pid is in place before any collective looks for it
        self._peers = [int(pid) for r, pid in enumerate(self._header[:, _PID]) if r != rank]

    def _map_segment(self, nbytes: int) -> mmap.mmap:
        """Rank 0 creates the file and names it to the others; it is unlinked once all have mapped it, so a
        crash leaves nothing behind in /dev/shm."""
        names: list[str | None] = [None]
        if self.rank == 0:
            path = Path("/dev/shm") / f"kvyard-tp-{os.getpid()}-{time.monotonic_ns()}"
            with open(path, "wb") as f:
                f.truncate(nbytes)
            names[0] = str(path)
        dist.broadcast_object_list(names, src=0)
        with open(names[0], "r+b") as f:  # type: ignore[arg-type]
            mm = mmap.mmap(f.fileno(), nbytes)
        dist.barrier()
        if self.rank == 0:
            os.unlink(names[0])  # type: ignore[arg-type]
        return mm

    # ---- collectives ---------------------------------------------------------------------------------

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        flat = t.view(-1) if t.is_contiguous() else t.contiguous().view(-1)
        per_chunk = self.slot_bytes // t.element_size()
        for start in range(0, flat.numel(), per_chunk):
            chunk = flat[start : start + per_chunk]
            views = self._exchange(chunk)
            self._sum_into(chunk, views)
            self._finish()
        if flat.data_ptr() != t.data_ptr():
            t.copy_(flat.view_as(t))
        self.all_reduces += 1
        self.bytes_reduced += t.numel() * t.element_size()
        return t

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        flat = t.contiguous().view(-1)
        shares = [torch.empty_like(flat) for _ in range(self.size)]
        per_chunk = self.slot_bytes // t.element_size()
        for start in range(0, flat.numel(), per_chunk):
            views = self._exchange(flat[start : start + per_chunk])
            for share, view in zip(shares, views, strict=True):
                share[start : start + view.numel()].copy_(view)
            self._finish()
        self.gathers += 1
        self.bytes_gathered += t.numel() * t.element_size()
        return [s.view_as(t) for s in shares]

    def all_gather_columns(self, t: torch.Tensor, widths: list[int]) -> torch.Tensor:
        """Every rank's [rows, widths[rank]] tensor side by side, in rank order: [rows, sum(widths)], copied
        straight from the segment into place, as many whole rows a collective as a slot holds (no padded
        shares, no separate concatenation: for 32 rows of a 151,936-token vocabulary those copies cost
        milliseconds a step)."""
        rows_a_slot = self.slot_bytes // (max(widths) * t.element_size())
        if rows_a_slot == 0:  # a row larger than a slot: gather in element chunks, then place the shares
            return super().all_gather_columns(t, widths)
        rows = t.shape[0]
        out = t.new_empty(rows, sum(widths))
        starts = [sum(widths[:r]) for r in range(self.size)]
        for first in range(0, rows, rows_a_slot):
            last = min(rows, first + rows_a_slot)
            views = self._exchange(t[first:last].contiguous().view(-1), [(last - first) * w for w in widths])
            for view, start, w in zip(views, starts, widths, strict=True):
                out[first:last, start : start + w].copy_(view.view(last - first, w))
            self._finish()
        self.gathers += 1
        self.bytes_gathered += t.numel() * t.element_size()
        return out

    def _exchange(self, chunk: torch.Tensor, numels: list[int] | None = None) -> list[torch.Tensor]:
        """Publish this rank's chunk; return every rank's (`numels[r]` elements, default as many as this
        rank's), in rank order, as views of the segment."""
        self._seq += 1
        seq, buf = self._seq, self._seq % 2
        self._wait(_DONE, seq - 2)  # every rank is done reading this buffer's last collective
        nbytes = chunk.numel() * chunk.element_size()
        self._slots[buf, self.rank, :nbytes].view(chunk.dtype).copy_(chunk)
        self._header[self.rank, _WRITTEN] = seq
        self._wait(_WRITTEN, seq)
        counts = numels or [chunk.numel()] * self.size
        return [self._slots[buf, r, : n * chunk.element_size()].view(chunk.dtype) for r, n in enumerate(counts)]

    def _finish(self) -> None:
        self._header[self.rank, _DONE] = self._seq

    @staticmethod
    def _sum_into(out: torch.Tensor, views: list[torch.Tensor]) -> None:
        # The same order on every rank, so every rank has the same bits. Low precision sums of more than two
        # are accumulated in fp32 and rounded once (two are rounded once anyway).
        if out.dtype == torch.float32 or len(views) == 2:
            torch.add(views[0], views[1], out=out)
            for v in views[2:]:
                out.add_(v)
        else:
            acc = views[0].float()
            for v in views[1:]:
                acc.add_(v)
            out.copy_(acc)

    def _wait(self, field: int, seq: int) -> None:
        column = self._header[:, field]
        spins = 0
        deadline = None
        while column.min() < seq:
            spins += 1
            if spins > _SPINS_BEFORE_YIELD:
                time.sleep(0)
            if spins % _CHECK_EVERY == 0:
                now = time.monotonic()
                deadline = deadline or now + self.timeout_s
                self._check_peers(now, deadline)

    def _check_peers(self, now: float, deadline: float) -> None:
        for pid in self._peers:
            if not process_alive(pid):
                raise PeerLostError(f"rank process {pid} of this tensor-parallel group is gone")
        if now > deadline:
            raise PeerLostError(f"a collective waited {self.timeout_s:.0f} s for the other ranks")

    def close(self) -> None:
        self._header = None  # type: ignore[assignment]
        self._slots = None  # type: ignore[assignment]
        try:
            self._mm.close()
        except BufferError:
            pass  # a view of the segment is still alive somewhere; the mapping goes with the process
        super().close()


def process_alive(pid: int) -> bool:
    """Whether process `pid` runs: a dead child not yet reaped still answers kill(pid, 0), so read its state."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
