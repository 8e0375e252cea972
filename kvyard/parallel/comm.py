"""A parallel replica's communication: the group of ranks a process belongs to, and its collectives.

`GlooGroup` runs them through torch.distributed over gloo (TCP, on one host or across hosts), each with a timeout,
so a dead peer ends a collective with an error instead of a hang. `SharedMemoryGroup` (shm.py), for ranks on one
host, runs them through a shared-memory segment instead (gloo only sets it up). A process joins one group (`join_group`)
before it builds its engine; the engine takes it from `current_group()`.
"""

import datetime
import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F

from kvyard.errors import ConfigError

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 60.0


class GlooGroup:
    def __init__(self, rank: int, size: int, master: str = "127.0.0.1:29531", timeout_s: float = DEFAULT_TIMEOUT_S,
                 driven: bool = False):
        if not 0 <= rank < size:
            raise ConfigError(f"rank {rank} is not in a group of {size}", param="rank")
        self.rank, self.size = rank, size
        # Rank 0 schedules and sends every step to the others (ranks.py), rather than every rank running the whole
        # engine on the same requests: the other ranks then only follow, and take part in no step of their own
        self.driven = driven
        dist.init_process_group("gloo", init_method=f"tcp://{master}", rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        self.all_reduces = 0  # collectives so far, and the bytes they carried (per rank, before the exchange)
        self.bytes_reduced = 0
        self.gathers = 0  # and the all-gathers (the logits' vocabulary shares)
        self.bytes_gathered = 0

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t)
        self.all_reduces += 1
        self.bytes_reduced += t.numel() * t.element_size()
        return t

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        shares = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(shares, t.contiguous())
        self.gathers += 1
        self.bytes_gathered += t.numel() * t.element_size()
        return shares

    def all_gather_columns(self, t: torch.Tensor, widths: list[int]) -> torch.Tensor:
        """Every rank's [rows, widths[rank]] tensor side by side, in rank order: [rows, sum(widths)]."""
        widest = max(widths)
        padded = F.pad(t, (0, widest - t.shape[-1])) if t.shape[-1] < widest else t
        return torch.cat([s[:, :w] for s, w in zip(self.all_gather(padded), widths, strict=True)], dim=-1)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


_current: GlooGroup | None = None


COMMS = ("shm", "gloo")


def join_group(rank: int, size: int, master: str = "127.0.0.1:29531", timeout_s: float = DEFAULT_TIMEOUT_S,
               comm: str = "shm", driven: bool = False) -> GlooGroup:
    """Join this process to a group of `size` ranks; the engines it builds from then on are its rank's share.
    `comm`: shm (every rank on this host) or gloo (ranks on several hosts)."""
    global _current
    if _current is not None:
        raise ConfigError("this process is already in a parallel group", param="rank")
    if comm not in COMMS:
        raise ConfigError(f"tensor_parallel_comm must be one of {', '.join(COMMS)}, not {comm!r}",
                          param="tensor_parallel_comm")
    if comm == "shm":
        from kvyard.parallel.shm import SharedMemoryGroup

        _current = SharedMemoryGroup(rank, size, master, timeout_s, driven=driven)
    else:
        _current = GlooGroup(rank, size, master, timeout_s, driven=driven)
    return _current


def leave_group() -> None:
    global _current
    if _current is not None:
        _current.close()
        _current = None


def current_group() -> GlooGroup | None:
    return _current
