"""What a parallel layout's ranks cost on this machine, measured, for the planner's layouts here (#38).

On one host a replica's processes split its cores (kvyard/parallel/affinity.py): a rank computes with its share
of the threads, on its share of each matrix (tensor parallel) or of the layers (pipeline), and the ranks'
collectives go through shared memory (kvyard/parallel/shm.py). So a layout's step is timed as its ranks run it:
- `rank_matmul_timings`: one rank's matmuls (every layer's, at its tensor-parallel share, and its share of the
  vocabulary-parallel head) at the threads it gets;
- `pipe_seconds`: a tensor handed from one pipeline stage to the next, pickled through a pipe between
  processes as kvyard/parallel/pipeline.py hands a micro-batch's hidden states down and its logits back;
- `collective_seconds`: one all-reduce of a step's hidden states, and the gather of the logits' vocabulary
  shares, between ranks that are processes bound to their cores, through the engine's own shared-memory group.
"""

import math
import multiprocessing
import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch

from kvyard.models.config import ModelConfig
from kvyard.net import free_port
from kvyard.parallel.affinity import bind_process, cpu_share, replica_cpus
from kvyard.plan.measure import best_seconds, head_timings, model_matmul_timings
from kvyard.plan.rates import SharedCores

COLLECTIVE_REPEATS = 50  # collectives timed a size (the best of three runs of them)
SPAWN_TIMEOUT_S = 120.0


def rank_threads(processes: int) -> int:
    """The threads each of `processes` processes gets when they share this machine's cores."""
    return max(1, len(replica_cpus()) // processes)


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def rank_matmul_timings(cfg: ModelConfig, rows: tuple[int, ...], tp: int, processes: int, busy: int = 1
                        ) -> dict[int, float]:
    """rows -> seconds of one rank's matmuls over all the model's layers at its `tp` share, with the threads a
    rank of `processes` gets, while `busy` ranks (this one among them) run theirs at once on their own cores and
    share the memory's bandwidth: the slowest rank's."""
    if busy <= 1:
        with torch_threads(rank_threads(processes)):
            return model_matmul_timings(cfg, rows, tp=tp)
    ctx = multiprocessing.get_context("spawn")
    results: multiprocessing.Queue[dict[int, float]] = ctx.Queue()
    start = ctx.Barrier(busy)
    procs = [ctx.Process(target=_time_rank_matmuls, args=(cfg, rows, tp, i, processes, start, results), daemon=True)
             for i in range(busy)]
    return _collect(procs, results, lambda times: {r: max(t[r] for t in times) for r in rows})


def _time_rank_matmuls(cfg: ModelConfig, rows: tuple[int, ...], tp: int, index: int, processes: int,
                       start: "multiprocessing.synchronize.Barrier", results: "multiprocessing.Queue") -> None:
    share = cpu_share(index, processes, replica_cpus())
    if share:
        bind_process(share)
    torch.set_num_threads(rank_threads(processes))
    start.wait(SPAWN_TIMEOUT_S)  # every rank's matmuls at once
    results.put(model_matmul_timings(cfg, rows, tp=tp))


def _collect(procs: list, results: "multiprocessing.Queue", combine):  # type: ignore[no-untyped-def]
    """Start `procs`, and combine what each puts on `results` once all have."""
    for p in procs:
        p.start()
    try:
        return combine([results.get(timeout=SPAWN_TIMEOUT_S) for _ in procs])
    finally:
        _join(procs)


def _join(procs: list) -> None:
    """Wait a little for each process to end; kill what does not."""
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()


@dataclass(frozen=True)
class CollectiveTimes:
    all_reduce_s: dict[int, float]  # rows -> one all-reduce of [rows, hidden] bf16
    gather_s: dict[int, float]  # rows -> the gather of [rows, vocab / ranks] fp32 logits


def _time_collectives(rank: int, size: int, master: str, reduce_rows: tuple[int, ...], gather_rows: tuple[int, ...],
                      hidden: int, vocab_share: int, results: "multiprocessing.Queue[CollectiveTimes]") -> None:
    from kvyard.parallel.shm import SharedMemoryGroup

    share = cpu_share(rank, size, replica_cpus())
    if share:
        bind_process(share)
    torch.set_num_threads(rank_threads(size))
    group = SharedMemoryGroup(rank, size, master)
    reduce_s, gather_s = {}, {}
    for r in reduce_rows:
        hidden_states = torch.randn(r, hidden).to(torch.bfloat16)
        reduce_s[r] = _best(lambda: group.all_reduce_(hidden_states))  # noqa: B023 (called at once)
    for r in gather_rows:
        logits = torch.randn(r, vocab_share)
        gather_s[r] = _best(lambda: group.all_gather_columns(logits, [vocab_share] * size))  # noqa: B023
    group.close()
    results.put(CollectiveTimes(reduce_s, gather_s))


def _best(collective) -> float:  # type: ignore[no-untyped-def]
    """Seconds of one collective: the best of three runs of COLLECTIVE_REPEATS (every rank runs the same)."""
    def run() -> None:
        for _ in range(COLLECTIVE_REPEATS):
            collective()
    return best_seconds(run, repeats=3) / COLLECTIVE_REPEATS


def collective_seconds(size: int, reduce_rows: tuple[int, ...], gather_rows: tuple[int, ...], hidden: int,
                       vocab: int) -> CollectiveTimes:
    """A step's collectives between `size` ranks on this machine, each a process bound to its share of the cores
    (the way a replica's ranks run), the slowest rank's: all-reduces of the hidden states at `reduce_rows`, the
    logits' gather at `gather_rows`."""
    ctx = multiprocessing.get_context("spawn")
    results: multiprocessing.Queue[CollectiveTimes] = ctx.Queue()
    master = f"127.0.0.1:{free_port()}"
    share = math.ceil(vocab / size)
    procs = [ctx.Process(target=_time_collectives, args=(r, size, master, reduce_rows, gather_rows, hidden, share,
                                                       results), daemon=True)
             for r in range(size)]

    def slowest(times: list[CollectiveTimes]) -> CollectiveTimes:
        return CollectiveTimes({r: max(t.all_reduce_s[r] for t in times) for r in reduce_rows},
                               {r: max(t.gather_s[r] for t in times) for r in gather_rows})
    return _collect(procs, results, slowest)


def _acknowledge(pipe: "multiprocessing.connection.Connection") -> None:
    """The next stage: unpickle each tensor sent, and say so, until sent b''."""
    while data := pipe.recv_bytes():
        pickle.loads(data)
        pipe.send_bytes(b"1")


def pipe_seconds(rows: tuple[int, ...], width: int, dtype: torch.dtype) -> dict[int, float]:
    """rows -> seconds a [rows, width] tensor of `dtype` takes from one pipeline stage to the next: pickled down
    a pipe between processes and unpickled, as kvyard/parallel/pipeline.py hands hidden states down and logits
    back (the best of three runs of COLLECTIVE_REPEATS)."""
    ctx = multiprocessing.get_context("spawn")
    mine, theirs = ctx.Pipe()
    child = ctx.Process(target=_acknowledge, args=(theirs,), daemon=True)
    child.start()
    try:
        out = {}
        for r in rows:
            t = torch.randn(r, width).to(dtype)

            def hand_over() -> None:
                mine.send_bytes(pickle.dumps(t))  # noqa: B023 (called at once)
                mine.recv_bytes()
            out[r] = _best(hand_over)
        mine.send_bytes(b"")
        return out
    finally:
        _join([child])


def shared_cores(cfg: ModelConfig, tp: int, pp: int, batch: int, prefill_rows: int) -> SharedCores:
    """Everything a tp x pp layout's ranks take on this machine's cores, measured at batch 1 and `batch` rows (and
    a micro-batch's), its collectives at a prefill step's `prefill_rows` too; the syncs left at 0 (fitted apart)."""
    ranks = tp * pp
    rows = tuple(sorted({1, max(1, batch // pp), batch}))
    shared = SharedCores(rank_matmul_timings(cfg, rows, tp, ranks, busy=ranks), {}, {})
    if tp > 1:
        times = collective_seconds(tp, (*rows, prefill_rows), rows, cfg.hidden_size, cfg.vocab_size)
        shared = replace(shared, all_reduce_s=times.all_reduce_s, gather_s=times.gather_s)
    if pp > 1:
        with torch_threads(rank_threads(ranks)):
            head_s = head_timings(cfg, rows, tp)
        shared = replace(shared, hidden_pipe_s=pipe_seconds((*rows, prefill_rows), cfg.hidden_size, torch.bfloat16),
                         logits_pipe_s=pipe_seconds(rows, cfg.vocab_size, torch.float32),
                         matmul_alone_s=rank_matmul_timings(cfg, rows, tp, ranks, busy=tp), head_s=head_s)
    return shared
