"""A parallel replica against one process in the same run (`kvyard bench offline --tensor-parallel-size N`).

The single-process baseline gets every core's threads; each rank of the parallel replica gets its share (rank 0
runs in this process, so the bench sets torch's thread count before each system's turn). Beside throughput it
reports what the layout costs: collectives and bytes moved per step and per generated token, and the weight
memory each rank holds.
"""

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import torch

from kvyard.config import EngineConfig
from kvyard.llm import LLM
from kvyard.parallel.affinity import bind_process
from kvyard.parallel.comm import current_group


@contextlib.contextmanager
def torch_threads(n: int, cores: set[int]) -> Iterator[None]:
    """This process's torch threads, n of them, on `cores` while the block runs (rank 0 is bound to its share
    of the cores otherwise, kvyard/parallel/affinity.py)."""
    threads_before = torch.get_num_threads()
    cores_before = bind_process(cores)
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(threads_before)
        bind_process(cores_before)


def weight_bytes(llm: LLM) -> int:
    """The bytes of the weights this process's model holds (each storage once: a tied head is the embedding)."""
    seen: dict[int, int] = {}
    for t in llm.engine.runner.model.weight_tensors():
        try:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        except NotImplementedError:  # a weight packed into oneDNN's opaque layout (AMX)
            seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())


class SingleProcessBaseline:
    """The same engine configuration on one process with all the cores, run in turn with the parallel one."""

    def __init__(self, cfg: EngineConfig, parallel_threads: int, cores: set[int]):
        """`cores`: the machine's, as this process had them before rank 0 bound itself to its share."""
        self.cores = cores
        self.threads = len(cores)
        self.parallel_threads = parallel_threads
        with torch_threads(self.threads, cores):
            self.llm = LLM(config=replace(cfg, tensor_parallel_size=1, pipeline_parallel_size=1,
                                          enable_expert_parallel=False, num_threads=self.threads))

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        with torch_threads(self.threads, self.cores):
            return fn(self.llm, *args)

    def close(self) -> None:
        self.llm.close()


class CommCounter:
    """What the ranks exchanged over a span of steps of `llm`'s engine: a tensor-parallel group's collectives,
    or a pipeline's messages (hidden states down, logits back), and their bytes."""

    def __init__(self, llm: LLM):
        self.llm = llm
        self.group = current_group()
        self.start = self._now()

    def _now(self) -> dict[str, int]:
        g, stats, runner = self.group, self.llm.engine.stats, self.llm.engine.runner
        # a pipeline's messages (hidden states down, logits back), and rank 0's group's collectives
        sent = {"collectives": getattr(runner, "messages", 0), "bytes": getattr(runner, "bytes_moved", 0)}
        if g is not None:
            sent = {"collectives": sent["collectives"] + g.all_reduces + g.gathers,
                    "bytes": sent["bytes"] + g.bytes_reduced + g.bytes_gathered}
        return {**sent, "steps": stats["steps"], "tokens": stats["generation_tokens"]}

    def per_step_and_token(self) -> dict[str, float]:
        now = self._now()
        d = {k: now[k] - self.start[k] for k in now}
        steps, tokens = max(1, d["steps"]), max(1, d["tokens"])
        return {"collectives_per_step": d["collectives"] / steps, "bytes_per_step": d["bytes"] / steps,
                "collectives_per_token": d["collectives"] / tokens, "bytes_per_token": d["bytes"] / tokens}


def layout_report(llm: LLM, baseline: SingleProcessBaseline, counter: CommCounter) -> dict[str, Any]:
    group, cfg = current_group(), llm.engine.cfg
    return {
        "tensor_parallel_size": cfg.tensor_parallel_size,
        "pipeline_parallel_size": cfg.pipeline_parallel_size,
        "pipeline_overlap": cfg.pipeline_overlap,
        "expert_parallel": cfg.expert_placement if cfg.enable_expert_parallel else None,
        "bind_threads": cfg.bind_threads,
        "overlapped_steps": llm.engine.stats["overlapped_steps"],
        "comm": type(group).__name__ if group else "pipes",
        "threads_per_rank": baseline.parallel_threads,
        "baseline_threads": baseline.threads,
        "weight_bytes_rank0": weight_bytes(llm),
        "weight_bytes_single_process": weight_bytes(baseline.llm),
        **counter.per_step_and_token(),
    }
