"""One replica as a group of ranks on one host: rank 0 is the engine that schedules, the others follow its steps.

`LLMEngine(tensor_parallel_size=N)` in a process that is in no group starts N - 1 worker processes (spawned, so
they share nothing but what they are sent), joins the group as rank 0, and builds its share of the model while
they build theirs. Each step, rank 0's runner (`DrivingRunner`) sends the step's inputs to every worker over a
pipe of its own, then runs its share; the workers run theirs, and the layers' all-reduces meet. The pipes carry
plain pickles (the tensors' bytes), not shared-memory handles, so a step outlives nothing. A worker whose
driver is gone (its pipe closed or its parent dead) exits.
"""

import logging
import multiprocessing
import os
import pickle
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import torch

from kvyard.engine.model_runner import ModelRunner, StepInput
from kvyard.net import free_port
from kvyard.parallel.affinity import bind_process, bind_replica_process, replica_cpus
from kvyard.parallel.comm import current_group, join_group, leave_group

if TYPE_CHECKING:
    from kvyard.config import EngineConfig
    from kvyard.engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)

POLL_S = 1.0  # how often an idle worker checks that its driver is alive
STOP = b"stop"


@dataclass
class Workers:
    """The processes a replica's rank 0 started: its tensor-parallel peers and, with pipeline parallelism, the
    later stages (each the rank 0 of its own stage's peers)."""

    processes: list[multiprocessing.process.BaseProcess]
    pipes: list[Connection]  # what rank 0 writes each step to: its tensor-parallel peers
    returns: list[Connection] = field(default_factory=list)  # what it reads back (a pipeline's logits)
    downstream: Connection | None = None  # where a pipeline's hidden states go: stage 1
    affinity: set[int] | None = None  # the cores rank 0 ran on before it bound itself to its share

    def with_stages(self, stages: "Workers") -> "Workers":
        return Workers(self.processes + stages.processes, self.pipes, stages.returns, stages.downstream)

    def stop(self, timeout: float = 10.0) -> None:
        for pipe in self.pipes + ([self.downstream] if self.downstream else []):
            try:
                pipe.send_bytes(STOP)
            except OSError:
                pass  # that worker is gone already
        for p in self.processes:
            p.join(timeout)
            if p.is_alive():
                p.kill()
        for pipe in self.pipes:
            pipe.close()
        if self.affinity is not None:
            bind_process(self.affinity)
            self.affinity = None
        leave_group()


def share_threads(cfg: "EngineConfig") -> "EngineConfig":
    """Without a thread count chosen, the cores shared out between the replica's processes (every rank of every
    stage, this one included), not each taking them all."""
    if cfg.num_threads is not None:
        return cfg
    processes = cfg.tensor_parallel_size * cfg.pipeline_parallel_size
    cfg = replace(cfg, num_threads=max(1, len(replica_cpus()) // processes))
    torch.set_num_threads(cfg.num_threads)
    return cfg


def start_workers(cfg: "EngineConfig", size: int, stage: tuple[int, int] = (0, 1)) -> Workers:
    """Spawn ranks 1..size-1 and join the group as rank 0 (which waits for them to join too). `stage`: the
    pipeline stage (of how many) whose layers the group holds."""
    ctx = multiprocessing.get_context("spawn")
    master = f"127.0.0.1:{free_port()}"
    cfg = share_threads(cfg)
    processes, pipes = [], []
    for rank in range(1, size):
        mine, theirs = ctx.Pipe(duplex=False)  # (read end, write end)
        p = ctx.Process(target=_worker_main, args=(rank, size, master, asdict(cfg), mine, os.getpid(), stage),
                        name=f"kvyard-rank-{rank}", daemon=True)
        p.start()
        mine.close()
        processes.append(p)
        pipes.append(theirs)
    try:
        join_group(0, size, master, comm=cfg.tensor_parallel_comm, driven=True)
    except BaseException:
        Workers(processes, pipes).stop(timeout=1)
        raise
    return Workers(processes, pipes)


class DrivingRunner(ModelRunner):
    """Rank 0's runner: every step's inputs go to the other ranks before it runs its own share."""

    def __init__(self, workers: Workers, *runner_args: Any):
        super().__init__(*runner_args)
        self.pipes = workers.pipes

    def restart(self, workers: Workers) -> None:
        """Drive a restarted gang: its new pipes, and the new group the model's collectives go through."""
        self.pipes = workers.pipes
        if self.pipes:  # a pipeline's stage 0 without tensor parallelism drives no peers
            self.model.group = current_group()

    def execute(self, step: StepInput) -> torch.Tensor:
        data = pickle.dumps((step.input_ids, step.positions, step.meta, step.logits_indices))
        for pipe in self.pipes:
            pipe.send_bytes(data)
        return super().execute(step)


def _worker_main(rank: int, size: int, master: str, cfg: dict[str, Any], pipe: Connection, parent: int,
                 stage: tuple[int, int]) -> None:
    from kvyard.config import EngineConfig
    from kvyard.engine.llm_engine import LLMEngine
    from kvyard.parallel.pipeline import enter_stage

    enter_stage(*stage)
    engine_config = EngineConfig(**cfg)
    bind_replica_process(engine_config, stage[0] * engine_config.tensor_parallel_size + rank)
    join_group(rank, size, master, comm=cfg["tensor_parallel_comm"], driven=True)
    try:
        follow(LLMEngine(engine_config), pipe, parent)
    finally:
        leave_group()


def follow(engine: "LLMEngine", pipe: Connection, parent: int | None) -> None:
    """Run rank 0's steps on this rank's share until it says stop, or is gone."""
    runner = engine.runner
    for data in incoming(pipe, parent):
        input_ids, positions, meta, logits_indices = pickle.loads(data)
        runner.model.forward(input_ids, positions, meta, runner.kv_caches, logits_indices)


def incoming(pipe: Connection, parent: int | None) -> Iterator[bytes]:
    """The messages on a rank's inbound pipe, until rank 0 says stop, closes it, or its process (`parent`; None:
    a rank placed by Ray, which goes with its placement group) is gone."""
    while True:
        if not pipe.poll(POLL_S):
            if parent is not None and os.getppid() != parent:
                log.warning("rank 0 is gone; this rank stops")
                return
            continue
        try:
            data = pipe.recv_bytes()
        except (EOFError, OSError):
            return
        if data == STOP:
            return
        yield data
