"""Pipeline parallelism: the layers split into stages, each stage a process holding only its layers' weights
and KV cache.

Stage 0 (the engine that schedules and samples) embeds the step's tokens and runs its layers; the hidden
states go down a pipe to stage 1 with the step's inputs, which runs its layers and passes them on; the last
stage holds the final norm and the LM head and sends the logits back to stage 0. The residual stream is the
only state that crosses a stage (the decoder adds each layer's outputs to it in place). Layer indices and
weight names stay global, so one loader serves every layout: a stage takes the tensors of its layers.

All stages size their KV pools alike (as if each held the largest share of layers), so the block ids rank 0
hands out mean the same slots on every stage.
"""

import multiprocessing
import os
import pickle
import queue
import re
import threading
from collections.abc import Iterable
from dataclasses import asdict, replace
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import torch

from kvyard.engine.model_runner import StepInput
from kvyard.errors import ConfigError
from kvyard.models.config import ModelConfig
from kvyard.models.decoder import DecoderModel, rms_norm
from kvyard.models.kv_layer import LayerKV
from kvyard.parallel.affinity import bind_replica_process
from kvyard.parallel.ranks import POLL_S, STOP, DrivingRunner, Workers, incoming, share_threads
from kvyard.parallel.shares import contiguous_share
from kvyard.parallel.shm import PeerLostError, process_alive
from kvyard.parallel.tensor import TP_MODEL_TYPES, Collective, TensorParallelDecoder
from kvyard.quant.qtensor import QuantizedTensor

if TYPE_CHECKING:
    from kvyard.config import EngineConfig
    from kvyard.engine.llm_engine import LLMEngine
    from kvyard.models.attention import AttentionMetadata


_LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")
_stage: tuple[int, int] | None = None  # (stage, stages) of a process started as a later stage


def stage_layers(num_layers: int, stage: int, stages: int) -> range:
    """The global indices of stage `stage`'s layers: contiguous, near-equal shares, the first stages one more."""
    return contiguous_share(num_layers, stages, stage)


def check_pipeline_parallel(cfg: ModelConfig, stages: int) -> None:
    if cfg.model_type not in TP_MODEL_TYPES:
        raise ConfigError(f"pipeline parallelism supports {', '.join(TP_MODEL_TYPES)} for now, not {cfg.model_type}",
                          param="pipeline_parallel_size")
    if not 1 <= stages <= cfg.num_layers:
        raise ConfigError(f"pipeline_parallel_size {stages} must be between 1 and the model's {cfg.num_layers} "
                          "layers", param="pipeline_parallel_size")


def pool_config(cfg: ModelConfig, stages: int) -> ModelConfig:
    """The model as every stage sizes its KV pool: the largest stage's layers (stage 0's)."""
    return replace(cfg, num_layers=len(stage_layers(cfg.num_layers, 0, stages)))


def stage_config(cfg: ModelConfig, stage: int, stages: int) -> ModelConfig:
    """The model as a stage allocates its KV cache: its own layers."""
    return replace(cfg, num_layers=len(stage_layers(cfg.num_layers, stage, stages)))


def current_stage() -> tuple[int, int] | None:
    return _stage


def enter_stage(stage: int, stages: int) -> None:
    """This process holds stage `stage`'s layers (a later stage, or a tensor-parallel peer of any stage)."""
    global _stage
    _stage = (stage, stages) if stages > 1 else None


class StageLayers:
    """What makes a decoder one stage of a pipeline: its layers; the first stage also embeds, the last also
    normalises and computes the logits. Mixed into the plain and the tensor-parallel decoders."""

    cfg: ModelConfig
    final_norm: torch.Tensor | None

    def _enter_stage(self, stage: int, stages: int) -> None:
        self.stage, self.stages = stage, stages
        self.holds_embedding = stage == 0
        self.holds_head = stage == stages - 1

    def layer_indices(self) -> range:
        return stage_layers(self.cfg.num_layers, self.stage, self.stages)

    def load(self, tensors: Iterable[tuple[str, torch.Tensor | QuantizedTensor]], source: str) -> None:
        super().load(((name, t) for name, t in tensors if self._holds(name)), source)

    def _holds(self, name: str) -> bool:
        layer = _LAYER_INDEX.match(name)
        if layer:
            return int(layer.group(1)) in self.layer_indices()
        if name == "model.embed_tokens.weight":
            return self.holds_embedding or (self.holds_head and self.cfg.tie_word_embeddings)
        return self.holds_head  # the final norm and the LM head

    @torch.inference_mode()
    def forward(self, inputs: torch.Tensor, positions: torch.Tensor, meta: "AttentionMetadata",
                kv_caches: list[LayerKV], logits_indices: torch.Tensor) -> torch.Tensor:
        """Stage 0 takes the token ids, a later stage the hidden states of the one before; the last stage
        returns fp32 logits for the rows in logits_indices, the others their hidden states."""
        x = self.embed_inputs(inputs, meta) if self.holds_embedding else inputs
        x = self.run_layers(x, positions, meta, kv_caches)
        if not self.holds_head:
            return x
        return self.logits(rms_norm(x[logits_indices], self.final_norm, self.cfg.rms_norm_eps))


class PipelineStageDecoder(StageLayers, DecoderModel):
    def __init__(self, cfg: ModelConfig, stage: int, stages: int, dtype: torch.dtype, device: torch.device,
                 max_positions: int, max_rows: int | None = None):
        DecoderModel.__init__(self, cfg, dtype, device, max_positions, max_rows)
        self._enter_stage(stage, stages)


class TensorParallelStage(StageLayers, TensorParallelDecoder):
    """A stage whose layers are split over the stage's tensor-parallel ranks (a group of their own)."""

    def __init__(self, cfg: ModelConfig, group: Collective, stage: int, stages: int, dtype: torch.dtype,
                 device: torch.device, max_positions: int, max_rows: int | None = None,
                 expert_placement: str | None = None):
        TensorParallelDecoder.__init__(self, cfg, group, dtype, device, max_positions, max_rows, expert_placement)
        self._enter_stage(stage, stages)


class PipelineDriver(DrivingRunner):
    """Stage 0's runner: its layers (its tensor-parallel peers', if any, too), then the hidden states down the
    pipeline, then the logits back."""

    def __init__(self, workers: Workers, *runner_args: Any):
        super().__init__(workers, *runner_args)
        self.workers = workers
        self.sender = PipeSender(workers.downstream)  # type: ignore[arg-type]
        self.messages = 0  # sent down the pipeline and received back, and their bytes (the bench's figures)
        self.bytes_moved = 0

    def restart(self, workers: Workers) -> None:
        super().restart(workers)
        self.sender.close()
        self.workers = workers
        self.sender = PipeSender(workers.downstream)  # type: ignore[arg-type]

    def execute(self, step: StepInput) -> torch.Tensor:
        self.launch(step)
        return self.collect()

    def launch(self, step: StepInput) -> None:
        """Stage 0's layers on the step, and the hidden states on to stage 1."""
        hidden = super().execute(step)
        data = pickle.dumps((hidden, step.positions, step.meta, step.logits_indices))
        self.sender.send(data)
        self._count(data)

    def collect(self) -> torch.Tensor:
        """The logits of the oldest step launched (the stages keep their order)."""
        data = receive(self.workers.returns[0], self.workers.processes)
        self._count(data)
        return pickle.loads(data)

    def _count(self, data: bytes) -> None:
        self.messages += 1
        self.bytes_moved += len(data)


class PipeSender:
    """Writes to a pipe on a thread of its own, in order. With batches in flight, stage 0 would otherwise block
    writing the next batch's hidden states while the last stage blocks writing the logits stage 0 has not read
    yet: a pipe holds 64 KiB, a step's logits megabytes."""

    def __init__(self, pipe: Connection):
        self.pipe = pipe
        self.queue: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self.error: OSError | None = None
        threading.Thread(target=self._run, name="kvyard-pipeline-send", daemon=True).start()

    def send(self, data: bytes) -> None:
        if self.error is not None:
            raise PeerLostError(f"stage 1's pipe failed: {self.error}")
        self.queue.put(data)

    def close(self) -> None:
        self.queue.put(None)

    def _run(self) -> None:
        while (data := self.queue.get()) is not None:
            try:
                self.pipe.send_bytes(data)
            except OSError as e:  # the stage is gone: the next send, or the logits' read, reports it
                self.error = e
                return


def receive(pipe: Connection, processes: list[multiprocessing.process.BaseProcess]) -> bytes:
    """The next message on `pipe`, or PeerLostError as soon as a stage is gone (never a hang)."""
    while not pipe.poll(POLL_S):
        gone = [p.name for p in processes if not process_alive(p.pid)]  # type: ignore[arg-type]
        if gone:
            raise PeerLostError(f"pipeline stage {', '.join(gone)} is gone")
    try:
        return pipe.recv_bytes()
    except (EOFError, OSError) as e:
        raise PeerLostError("a pipeline stage closed its pipe") from e


def start_stages(cfg: "EngineConfig", stages: int) -> Workers:
    """Spawn stages 1..stages-1, chained by pipes: stage s reads from stage s - 1 and writes to stage s + 1, the
    last one back to stage 0 (this process)."""
    ctx = multiprocessing.get_context("spawn")
    cfg = share_threads(cfg)
    links = [ctx.Pipe(duplex=False) for _ in range(stages)]  # link s: (read end, write end) from stage s onwards
    processes = []
    for stage in range(1, stages):
        p = ctx.Process(target=_stage_main, args=(stage, stages, asdict(cfg), links[stage - 1][0], links[stage][1],
                                                  os.getpid()), name=f"kvyard-stage-{stage}", daemon=True)
        p.start()
        processes.append(p)
    for stage in range(1, stages):  # this process keeps only the first link's write end and the last's read end
        links[stage - 1][0].close()
        links[stage][1].close()
    return Workers(processes, [], returns=[links[-1][0]], downstream=links[0][1])


def _stage_main(stage: int, stages: int, cfg: dict[str, Any], inbound: Connection, outbound: Connection,
                parent: int) -> None:
    from kvyard.config import EngineConfig
    from kvyard.engine.llm_engine import LLMEngine

    enter_stage(stage, stages)
    engine_config = EngineConfig(**cfg)
    bind_replica_process(engine_config, stage * engine_config.tensor_parallel_size)
    # The stage is a daemon (stage 0 ends it if it exits), and multiprocessing refuses a daemon children: this
    # stage's tensor-parallel peers. They are safe orphans: each exits once it sees its parent gone (ranks.incoming).
    multiprocessing.current_process()._config["daemon"] = False  # type: ignore[attr-defined]
    follow_stage(LLMEngine(engine_config), inbound, outbound, parent)


def follow_stage(engine: "LLMEngine", inbound: Connection, outbound: Connection, parent: int) -> None:
    """Run this stage's layers on what the stage before sends, and send on what they give, until told to stop."""
    runner = engine.runner
    for data in incoming(inbound, parent):
        hidden, positions, meta, logits_indices = pickle.loads(data)
        # (a stage's rank 0 sends it to the stage's tensor-parallel peers first)
        out = runner.execute(StepInput(hidden, positions, meta, logits_indices, sampled=[]))
        # to the next stage with the step's inputs, or (the last stage's logits) back to stage 0
        outbound.send_bytes(pickle.dumps(out if runner.model.holds_head else (out, positions, meta, logits_indices)))
    try:
        outbound.send_bytes(STOP)  # the stages after this one stop too (the last one's goes to stage 0)
    except OSError:
        pass
