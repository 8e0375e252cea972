"""Where a fetcher puts a transfer that arrives layer by layer: copies in warm memory (warm_buffers), or
for a same-host segment read in place, nothing at all.

ZeroMQ frames are copied because ZeroMQ allocates each received frame afresh and malloc returns large freed blocks
to the kernel, so the page faults of fresh memory cost more than a copy into pages already mapped (46 MB
in 30 layer messages on this VM: 15-17 ms kept as ZeroMQ frames, 10.5 ms copied out, checksums included).
The fetcher checks each layer (sizes, checksums) right after its copy, while it is still in the CPU's
cache, and it checks the copy: a segment rewritten mid-copy (a lease that ran out) fails its checksum
instead of passing unnoticed.

A shared-memory segment is copied only when the caller wants the payload for good (`dst` given), since the
source reuses it after the ack. A decode worker instead reads it in place (`dst` None): the engine scatters
straight from the segment into its cache and acknowledges after that, within the fetch's lease, which
saves the copy and both checksum passes (46 MB of SmolLM2 KV in service: 40-66 ms -> 25-41 ms with the
copy gone).
"""

import warnings

import numpy as np
import torch
import zmq

from kvyard.disagg.payload import KVIntegrityError


class LayerCopier:
    def __init__(self, transfer_id: str, sizes: list[int], offsets: list[int], per_layer: int,
                 dst: np.ndarray | None, segment: np.ndarray | None = None):
        """`sizes`, `offsets`: every frame's, as wire.frame_offsets lays them out in `dst` (and `segment`).
        `dst` None: the segment's frames are returned in place (read-only views)."""
        self.transfer_id, self.sizes, self.offsets, self.per_layer = transfer_id, sizes, offsets, per_layer
        self.dst, self.segment = dst, segment

    def layer(self, i: int, data: list[zmq.Frame]) -> list[torch.Tensor]:
        """Layer i's frames, copied from `data` (its message's data frames) or from the segment."""
        ks = range(i * self.per_layer, (i + 1) * self.per_layer)
        if self.segment is not None:
            if data:
                raise KVIntegrityError(f"transfer {self.transfer_id}: {len(data)} stray data frames with layer "
                                       f"{i} of a shared-memory transfer")
            return [self._frame(k, self.segment[self.offsets[k] : self.offsets[k] + self.sizes[k]]) for k in ks]
        bufs = [memoryview(f) for f in data]
        if [b.nbytes for b in bufs] != [self.sizes[k] for k in ks]:
            return [frame_tensor(b) for b in bufs]  # not what was announced: left for the checks to name
        return [self._frame(k, np.frombuffer(b, dtype=np.uint8)) for k, b in zip(ks, bufs, strict=True)]

    def _frame(self, k: int, src: np.ndarray) -> torch.Tensor:
        if self.dst is None:
            with warnings.catch_warnings():  # torch warns that a read-only array makes a read-only tensor
                warnings.simplefilter("ignore", UserWarning)
                return torch.from_numpy(src)
        # numpy copies on this thread alone; torch's copy_ would start an OpenMP team next to the engine's.
        out = self.dst[self.offsets[k] : self.offsets[k] + self.sizes[k]]
        np.copyto(out, src)
        return torch.from_numpy(out)


def frame_tensor(buf: memoryview) -> torch.Tensor:
    """A received frame as a uint8 tensor, without a copy (the tensor keeps the frame alive)."""
    return torch.frombuffer(buf, dtype=torch.uint8) if buf.nbytes else torch.empty(0, dtype=torch.uint8)
