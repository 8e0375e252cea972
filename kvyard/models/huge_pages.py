"""Model weights moved onto transparent huge pages, once, after loading (DecoderModel.load).

A decode step streams every weight from memory. On 4 KB pages that stream crosses a page every 4 KB in
each of a matmul's row streams, and each crossing can miss the TLB and walk the page tables; on 2 MB pages
it almost never does. Where weights land is otherwise an accident of the loader: a GGUF's tensors come
from numpy (which advises huge pages for large arrays), a safetensors checkpoint's from PyTorch's
allocator (which does not, short of THP_MEM_ALLOC_ENABLE set before torch is imported), so a quantized
checkpoint and its bf16 source were streamed from different kinds of pages.

`move_to_huge_pages` copies each distinct storage into one anonymous mapping advised MADV_HUGEPAGE and
points every tensor that used it at the copy (`Tensor.set_`), so the objects holding the tensors need not
know. Where the kernel grants no huge pages (THP "never"), the mapping is ordinary memory and nothing is
lost but the copy. KVYARD_HUGE_PAGES=0 turns it off.
"""

import ctypes
import logging
import mmap
import os
import sys
from collections.abc import Iterable, Iterator

import torch

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_ALIGN = 4096  # each storage starts on a page of its own: a multiple of every element size
_MADV_COLLAPSE = getattr(mmap, "MADV_COLLAPSE", 25)  # Linux's value; Python's mmap names it from 3.13


def enabled() -> bool:
    return (sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE")
            and os.environ.get("KVYARD_HUGE_PAGES", "1") not in ("0", "false", "no"))


def tensors_in(values: Iterable[object]) -> Iterator[torch.Tensor]:
    """The tensors in `values`, and in the attributes of the weight objects (VnniWeight, low-bit linears) among them."""
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, tuple | list):
            yield from tensors_in(v)
        elif hasattr(v, "__dict__"):
            yield from tensors_in(vars(v).values())


def _movable(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.layout == torch.strided and not t.is_mkldnn and t.numel() > 0


def move_to_huge_pages(tensors: Iterable[torch.Tensor]) -> int:
    """Re-home the CPU storages behind `tensors` (shared storages once) on huge pages; returns bytes moved."""
    groups: dict[int, dict[int, torch.Tensor]] = {}  # storage -> the distinct tensor objects on it
    for t in tensors:
        if _movable(t):
            groups.setdefault(t.untyped_storage().data_ptr(), {})[id(t)] = t
    if not groups or not enabled():
        return 0
    members = [list(g.values()) for g in groups.values()]
    sizes = [g[0].untyped_storage().nbytes() for g in members]
    total = sum(-(-n // _ALIGN) * _ALIGN for n in sizes)
    # Private: shared anonymous memory is shmem, which THP leaves alone unless shmem_enabled says otherwise
    arena = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    arena.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(arena, dtype=torch.uint8)  # keeps `arena` alive for as long as any view of it
    offset = -whole.data_ptr() % HUGE_PAGE  # start on a huge-page boundary
    storage = whole.untyped_storage()
    with torch.inference_mode():
        for group, nbytes in zip(members, sizes, strict=True):
            old = torch.empty(0, dtype=torch.uint8).set_(group[0].untyped_storage())
            whole[offset: offset + nbytes].copy_(old)
            for t in group:
                base = offset // t.element_size()
                t.set_(storage, base + t.storage_offset(), t.size(), t.stride())
            offset += -(-nbytes // _ALIGN) * _ALIGN
    _collapse(arena)
    _return_freed_heap()
    log.info("moved %.0f MB of weights onto huge pages", total / 1e6)
    return total


def _collapse(arena: mmap.mmap) -> None:
    """Have the kernel make huge pages of the whole mapping now, compacting memory if it must (MADV_COLLAPSE,
    Linux 6.1+). Faults in a mapping advised MADV_HUGEPAGE fall back to 4 KB pages where no free 2 MB page is at
    hand (fragmented memory), and khugepaged merges those only slowly in the background. A guard: the faults
    alone were granted huge pages in every case tried here."""
    try:
        arena.madvise(_MADV_COLLAPSE)
    except OSError:  # an older kernel, or THP off: the pages stay as the faults left them
        pass


def _return_freed_heap() -> None:
    """Give the old copies' heap pages back to the OS (glibc keeps freed heap memory otherwise)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
