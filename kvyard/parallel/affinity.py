"""Each process of a parallel replica bound to its own share of the cores (`--bind-threads`, the default).

A replica's processes (every rank of every stage) split the cores they were started on into contiguous,
near-equal shares: process i = stage * tensor_parallel_size + rank takes share i. Bound, a rank's torch threads
stay on its cores, and no two ranks' threads take turns on one core while the others wait at an all-reduce.
With fewer cores than processes nothing is bound (the shares would be empty).

The cores are the first process's (its affinity when it starts the others); they travel to the processes it
starts, and to theirs, in the environment, so every process computes the same shares.
"""

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from kvyard.parallel.shares import contiguous_share

if TYPE_CHECKING:
    from kvyard.config import EngineConfig

CPUS_ENV = "KVYARD_REPLICA_CPUS"


def replica_cpus() -> list[int]:
    """The cores the whole replica shares: as its first process found them."""
    given = os.environ.get(CPUS_ENV)
    return [int(c) for c in given.split(",")] if given else sorted(os.sched_getaffinity(0))


def cpu_share(index: int, processes: int, cpus: list[int]) -> set[int] | None:
    """Process `index`'s cores, of `processes` sharing `cpus`; None when there are too few to share."""
    if len(cpus) < processes:
        return None
    return {cpus[i] for i in contiguous_share(len(cpus), processes, index)}


def bind_process(cores: set[int]) -> set[int]:
    """Bind every thread of this process (torch's pool included) to `cores`; returns the affinity it had.
    Threads started later inherit it from the thread that starts them."""
    before = os.sched_getaffinity(0)
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except OSError:
            pass  # a thread that ended meanwhile
    return before


def bind_replica_process(cfg: "EngineConfig", index: int, cpus: list[int] | None = None) -> set[int] | None:
    """Bind process `index` of the replica `cfg` describes to its share (with cfg.bind_threads and cores
    enough); returns the affinity it had, or None where nothing was bound."""
    share = cpu_share(index, cfg.tensor_parallel_size * cfg.pipeline_parallel_size, cpus or replica_cpus())
    return bind_process(share) if cfg.bind_threads and share else None


@contextmanager
def cpus_for_children(cpus: list[int]) -> Iterator[None]:
    """While processes are spawned: they learn the replica's cores from their environment."""
    before = os.environ.get(CPUS_ENV)
    os.environ[CPUS_ENV] = ",".join(map(str, cpus))
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(CPUS_ENV, None)
        else:
            os.environ[CPUS_ENV] = before
