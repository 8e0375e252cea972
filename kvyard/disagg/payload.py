"""A received prompt's KV, and the checks it must pass before a decode worker may use it.

The decode worker writes these blocks into its own cache and then trusts them as if it had computed them,
so every disagreement is fatal: another layout, other block hashes (another tokenization, chat template
or cache salt), missing or mis-sized tensors. `check_payload` raises `KVIntegrityError` naming the first
reason; the transport raises `KVTransferError` when it cannot get a payload at all.
"""

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvyard.disagg.layout import KVLayout
from kvyard.errors import KvyardError


class KVIntegrityError(KvyardError):
    """A payload is corrupt, short or does not match what this worker expects; the message says how."""


class KVTransferError(KvyardError):
    """A payload could not be fetched: unreachable or silent source, timeout, unknown or released transfer."""


@dataclass
class KVPayload:
    transfer_id: str
    layout: KVLayout
    block_hashes: list[bytes]  # chained prefix-cache hashes (kvyard.engine.block_manager.block_hashes)
    token_ids: list[int]  # the tokens these blocks hold KV for: num_blocks * block_size of them
    tensors: list[list[torch.Tensor]]  # per layer [k, v] or [k, v, k_scale, v_scale], as gather_blocks returns
    nbytes: int
    # In-place payloads (a same-host source's shared-memory segment, read without a copy) stay readable
    # until this monotonic time and until `finish`; copied payloads are the caller's for good.
    valid_until: float = math.inf
    _finish: Callable[[str | None], None] | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def num_blocks(self) -> int:
        return len(self.block_hashes)

    @property
    def in_place(self) -> bool:
        return math.isfinite(self.valid_until)

    def on_finish(self, finish: Callable[[str | None], None]) -> None:
        self._finish = finish

    def finish(self, problem: str | None = None) -> None:
        """The caller is done with the tensors (`problem`: why they were unusable): the source may release
        them. Idempotent and thread-safe; a no-op for a copied payload, which was acknowledged on arrival."""
        with self._lock:
            f, self._finish = self._finish, None
        if f is not None:
            f(problem)


def check_payload(payload: KVPayload, layout: KVLayout, expected_hashes: list[bytes]) -> None:
    """Raise KVIntegrityError unless `payload` is exactly the KV this worker asked for, in its own layout."""
    diffs = layout.mismatches(payload.layout)
    if diffs:
        raise KVIntegrityError(f"transfer {payload.transfer_id}: KV layout mismatch: {'; '.join(diffs)}")
    check_hashes(payload.transfer_id, payload.block_hashes, expected_hashes)
    n = len(expected_hashes)
    if len(payload.token_ids) != n * layout.block_size:
        raise KVIntegrityError(f"transfer {payload.transfer_id}: {len(payload.token_ids)} token ids for "
                               f"{n} blocks of {layout.block_size}")
    if len(payload.tensors) != layout.num_layers:
        raise KVIntegrityError(f"transfer {payload.transfer_id}: {len(payload.tensors)} layers of KV, "
                               f"expected {layout.num_layers}")
    specs = layout.frame_specs(n)
    for i, layer in enumerate(payload.tensors):
        if len(layer) != len(specs):
            raise KVIntegrityError(f"transfer {payload.transfer_id}: layer {i} has {len(layer)} tensors, "
                                   f"expected {len(specs)}")
        for j, (t, (dtype, shape)) in enumerate(zip(layer, specs, strict=True)):
            if t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous():
                raise KVIntegrityError(
                    f"transfer {payload.transfer_id}: layer {i} tensor {j} is {t.dtype} {tuple(t.shape)}"
                    f"{'' if t.is_contiguous() else ' (not contiguous)'}, expected {dtype} {shape}")
    total = sum(t.nbytes for layer in payload.tensors for t in layer)
    if total != payload.nbytes:
        raise KVIntegrityError(f"transfer {payload.transfer_id}: tensors hold {total} bytes, "
                               f"payload says {payload.nbytes}")


def check_hashes(transfer_id: str, got: list[bytes], expected: list[bytes]) -> None:
    if len(got) != len(expected):
        raise KVIntegrityError(f"transfer {transfer_id}: {len(got)} blocks offered, {len(expected)} expected")
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        if g != e:
            raise KVIntegrityError(
                f"transfer {transfer_id}: block {i} hash {g.hex()[:16]}… differs from the expected "
                f"{e.hex()[:16]}… (the workers tokenized, templated or salted the prompt differently)")
