"""Run a function as every rank of a group, each in a spawned process, and collect what each sends back."""

import multiprocessing
import queue
from collections.abc import Callable
from typing import Any

import pytest

from kvyard.net import free_port


def spawn_ranks(target: Callable[..., None], size: int, *args: Any, wait_s: float) -> dict[int, Any]:
    """target(rank, size, port, *args, results) puts one (rank, result) on `results`; a rank silent for
    `wait_s` fails the test, and every process is gone when this returns."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, size, port, *args, results), daemon=True) for r in range(size)]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    try:
        for _ in range(size):
            rank, result = results.get(timeout=wait_s)
            got[rank] = result
    except queue.Empty:
        pytest.fail(f"ranks {sorted(set(range(size)) - set(got))} sent nothing in {wait_s} s")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return got
