"""Each process of a parallel replica bound to its own share of the cores, and rank 0 unbound again after."""

import os

import pytest

from kvyard import LLM
from kvyard.parallel.affinity import cpu_share


def test_shares_are_contiguous_near_equal_and_none_when_too_few():
    assert [cpu_share(i, 2, [0, 1, 2, 3]) for i in range(2)] == [{0, 1}, {2, 3}]
    assert [cpu_share(i, 3, [4, 5, 6, 7, 8]) for i in range(3)] == [{4, 5}, {6, 7}, {8}]
    assert cpu_share(0, 4, [0, 1]) is None


def _threads_affinity(pid: int) -> set[frozenset[int]]:
    return {frozenset(os.sched_getaffinity(int(tid))) for tid in os.listdir(f"/proc/{pid}/task")}


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to share out")
@pytest.mark.parametrize("bind", [True, False])
def test_every_thread_of_each_rank_runs_on_its_share(tiny_checkpoint, bind):
    cpus = sorted(os.sched_getaffinity(0))
    with LLM(str(tiny_checkpoint("llama")), dtype="float32", tensor_parallel_size=2, bind_threads=bind) as llm:
        llm.generate(["warm up every thread"])
        rank1 = llm.engine._workers.processes[0].pid
        if bind:
            assert _threads_affinity(os.getpid()) == {frozenset(cpu_share(0, 2, cpus))}
            assert _threads_affinity(rank1) == {frozenset(cpu_share(1, 2, cpus))}
        else:
            assert _threads_affinity(rank1) == {frozenset(cpus)}
    assert _threads_affinity(os.getpid()) == {frozenset(cpus)}  # rank 0 (here: the test) unbound again
