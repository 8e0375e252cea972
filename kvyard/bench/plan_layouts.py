"""`kvyard bench plan --layouts`: the planner's parallel layouts predicted against the engine's on this machine.

A layout here is a replica whose ranks share this machine's cores (kvyard/parallel/affinity.py), so it is
predicted from what its ranks were measured to take (kvyard.plan.measure_ranks): a rank's own matmuls at its
threads, the shared-memory collectives between bound processes, the layer cost fitted on a single process, and
and a per-stage-step sync of each kind (tensor ranks, pipeline stages) fitted on one layout of that kind
(--calibrate-layout-on) and used for the others out of sample.
Measured: the weight bytes rank 0 holds, decode tok/s at batch 1 and --batch (tokens counted, since a pipeline's
step carries one micro-batch), and prefill tok/s.
"""

import argparse
import functools
import os
import re
import statistics
from dataclasses import dataclass, replace

import torch

from kvyard.bench.decode_steps import decode_token_rate
from kvyard.bench.plan import (
    PREFILL_PROMPTS,
    calibrated_layer_cost,
    held_weight_bytes,
    measured,
    predicted,
    prefill_rate,
)
from kvyard.bench.workload import random_workload
from kvyard.config import EngineConfig
from kvyard.errors import ConfigError
from kvyard.llm import LLM
from kvyard.models.linear import packed_copies
from kvyard.plan.calibration import rank_key
from kvyard.plan.hardware import Device
from kvyard.plan.measure import model_matmul_timings
from kvyard.plan.measure_ranks import rank_threads, shared_cores, torch_threads
from kvyard.plan.model_spec import from_source
from kvyard.plan.rates import LayerCost, SharedCores, fit_sync
from kvyard.sampling_params import SamplingParams

STACK_ENV = "KVYARD_DECODE_STACK"  # kvyard.kernels.cpu.decode_stack_enabled


@dataclass(frozen=True)
class LayoutSpec:
    model: str
    tp: int
    pp: int

    @property
    def label(self) -> str:
        return f"{self.model} tp{self.tp}" + (f" pp{self.pp}" if self.pp > 1 else "")

    @property
    def ranks(self) -> int:
        return self.tp * self.pp


def parse_layout(spec: str) -> LayoutSpec:
    """MODEL:tpN, MODEL:ppN or MODEL:tpNppM."""
    m = re.fullmatch(r"(.+):(?:tp(\d+))?(?:pp(\d+))?", spec.strip())
    if not m or not (m[2] or m[3]):
        raise ConfigError(f"a layout is MODEL:tpN, MODEL:ppN or MODEL:tpNppM, not {spec!r}", param="layouts")
    return LayoutSpec(m[1], int(m[2] or 1), int(m[3] or 1))


def measured_layout(spec: LayoutSpec, args: argparse.Namespace) -> tuple[dict[str, float], int]:
    """The engine's figures for the layout, and the dense weights' packed copies its rank 0 keeps."""
    threads = torch.get_num_threads()  # rank 0 takes its share of the threads; given back after
    llm = LLM(config=EngineConfig(model=spec.model, dtype="bfloat16", tensor_parallel_size=spec.tp,
                                  pipeline_parallel_size=spec.pp))
    try:
        out = {}
        for batch in (1, args.batch):
            prompts = random_workload(llm.tokenizer, batch, args.input_len, 1, seed=batch).prompts
            params = SamplingParams(max_tokens=args.steps + 8, temperature=0.0, ignore_eos=True)
            out[f"decode_tok_s_batch_{batch}"] = statistics.median(
                decode_token_rate(llm, prompts, params, args.steps) for _ in range(3))
        out["prefill_tok_s"] = prefill_rate(llm, PREFILL_PROMPTS, args.prefill_len)
        out["weight_bytes"] = float(held_weight_bytes(llm))
        return out, packed_copies(llm.engine.runner.model.max_rows)
    finally:
        llm.close()
        torch.set_num_threads(threads)


def _rank_costs(spec: LayoutSpec, args: argparse.Namespace) -> SharedCores:
    return _measured_ranks(spec, args.batch, PREFILL_PROMPTS * args.prefill_len)


@functools.cache  # measured once a layout: the sync's fit and the prediction see the same costs
def _measured_ranks(spec: LayoutSpec, batch: int, prefill_rows: int) -> SharedCores:
    return shared_cores(from_source(spec.model).config, spec.tp, spec.pp, batch, prefill_rows)


def describe(spec: LayoutSpec, shared: SharedCores, batch: int) -> str:
    """What the layout's ranks were measured to take, for the log."""
    parts = [f"rank matmuls {shared.matmul_s[1] * 1e3:.1f} / {shared.matmul_s[batch] * 1e3:.1f} ms (1 / {batch} rows)"]
    if shared.matmul_alone_s:
        parts.append(f"one stage at a time {shared.matmul_alone_s[1] * 1e3:.1f} ms (1 row), of which the head "
                     f"{shared.head_s[1] * 1e3:.1f} / {shared.head_s[batch] * 1e3:.1f} ms")
    if shared.all_reduce_s:
        parts.append(f"all-reduce {shared.all_reduce_s[1] * 1e6:.0f} / {shared.all_reduce_s[batch] * 1e6:.0f} us, "
                     f"logits' gather {shared.gather_s[1] * 1e3:.2f} / {shared.gather_s[batch] * 1e3:.2f} ms")
    if shared.hidden_pipe_s:
        parts.append(f"hand-over {shared.hidden_pipe_s[1] * 1e3:.2f} ms down, logits back "
                     f"{shared.logits_pipe_s[1] * 1e3:.2f} / {shared.logits_pipe_s[batch] * 1e3:.2f} ms")
    return f"{spec.label}: " + "; ".join(parts)


def rank_layer_cost(dev: Device, threads: int, stack: bool, args: argparse.Namespace) -> LayerCost:
    """Each layer's cost outside its matmuls for a rank with `threads` threads, with the C++ decode stack or
    layer by layer (`stack`): fitted as for one process (on --calibrate-on), on its decode steps and matmuls run
    that way."""
    name = args.calibrate_on
    before = os.environ.get(STACK_ENV)
    os.environ[STACK_ENV] = "1" if stack else "0"
    try:
        with torch_threads(threads):
            llm = LLM(config=EngineConfig(model=name, dtype="bfloat16", num_threads=threads))
            copies = packed_copies(llm.engine.runner.model.max_rows)
            seen = measured(llm, args)
            del llm
            matmuls = model_matmul_timings(from_source(name).config, (1, args.batch))
    finally:
        if before is None:
            del os.environ[STACK_ENV]
        else:
            os.environ[STACK_ENV] = before
    return calibrated_layer_cost(name, dev, copies, seen, args, matmuls)


def predicted_layout(spec: LayoutSpec, dev: Device, copies: int, args: argparse.Namespace, layer_cost: LayerCost | None,
                     syncs: dict[str, float] | None = None) -> dict[str, float]:
    shared = replace(_rank_costs(spec, args), **(syncs or {}))
    return predicted(spec.model, dev, copies, args, layer_cost, tp=spec.tp, pp=spec.pp, shared=shared)


def fitted_sync(spec: LayoutSpec, dev: Device, copies: int, args: argparse.Namespace, layer_cost: LayerCost | None,
                seen: dict[str, float]) -> float:
    """The per-stage-step sync that closes the layout's measured decode steps (batch 1 and --batch) on average."""
    raw = predicted_layout(spec, dev, copies, args, layer_cost)
    steps = {b: (b / seen[f"decode_tok_s_batch_{b}"], b / raw[f"decode_tok_s_batch_{b}"]) for b in (1, args.batch)}
    return fit_sync({b: m for b, (m, _) in steps.items()}, {b: p for b, (_, p) in steps.items()}, spec.pp)


def sync_kind(spec: LayoutSpec) -> str:
    """The SharedCores sync a calibration layout fits: a tensor-parallel one's or a pipeline's, not both."""
    if (spec.tp > 1) == (spec.pp > 1):
        raise ConfigError(f"a calibration layout is tensor-parallel or a pipeline, not {spec.label}",
                          param="calibrate_layout_on")
    return "tensor_sync_s" if spec.tp > 1 else "stage_sync_s"


def layout_rows(dev: Device, args: argparse.Namespace
                ) -> tuple[list[dict], dict[str, float], dict[str, LayerCost]]:
    """Each --layouts layout predicted against measured, the calibration layouts' syncs fitted first; the rows
    (as run_plan_bench keeps them), the fitted syncs and the ranks' layer costs (by rank_key)."""
    specs = [parse_layout(s) for s in args.layouts.split(",")]
    calibrate = [parse_layout(s) for s in args.calibrate_layout_on.split(",")] if args.calibrate_layout_on else []
    kinds = {spec: sync_kind(spec) for spec in calibrate}
    rows, syncs, costs = [], {}, {}
    for spec in [*calibrate, *(s for s in specs if s not in calibrate)]:
        # a tensor-parallel rank runs its layers one by one (kvyard/parallel/tensor.py: no C++ decode stack, which
        # would run them all at once with no all-reduce between them)
        threads, stack = rank_threads(spec.ranks), spec.tp == 1
        how = rank_key(threads, stack)
        if how not in costs:
            costs[how] = rank_layer_cost(dev, threads, stack, args)
            print(f"layer cost at {how}, fitted on {args.calibrate_on}: {costs[how].fixed_s * 1e6:.1f} us + "
                  f"{costs[how].per_row_hidden_s * 1e9:.2f} ns a row and hidden unit")
        layer_cost = costs[how]
        seen, copies = measured_layout(spec, args)
        if spec in kinds:
            syncs[kinds[spec]] = fitted_sync(spec, dev, copies, args, layer_cost, seen)
            print(f"{kinds[spec]} fitted on {spec.label}: {syncs[kinds[spec]] * 1e3:.2f} ms a stage step")
            if spec not in specs:
                continue
        expected = predicted_layout(spec, dev, copies, args, layer_cost, syncs)
        print(describe(spec, _rank_costs(spec, args), args.batch))
        for figure, value in expected.items():
            error = value / seen[figure] - 1
            rows.append({"model": spec.label, "figure": figure, "predicted": value, "measured": seen[figure],
                         "error": error, "drift": abs(error) > args.tolerance,
                         "fitted_on": spec in kinds and figure.startswith("decode")})
    return rows, syncs, costs
