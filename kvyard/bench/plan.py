"""`kvyard bench plan`: the planner's predictions against measurements on this machine, kept as a standing
record (#38).

For each model: the weight bytes the planner predicts against what the loaded engine holds; decode tok/s at
batch 1 and 32 and prefill tok/s predicted on this machine's measured bandwidth and bf16 FLOPs
(kvyard.plan.measure) against kvyard's own engine. Each layer's cost outside its matmuls is fitted on one
model (--calibrate-on, SmolLM2 by default) and used for the others, whose figures stay out of sample. Each run
appends its rows to the record (JSON lines); any figure off by more than --tolerance is printed as DRIFT and the
command exits 1. A PNG shows every figure's error against the tolerance band.
"""

import argparse
import functools
import json
import statistics
import time
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kvyard.bench.output import machine_info
from kvyard.bench.quant import decode_rate
from kvyard.config import EngineConfig
from kvyard.llm import LLM
from kvyard.models.linear import packed_copies
from kvyard.plan.calibration import DEFAULT_RECORD
from kvyard.plan.hardware import Device
from kvyard.plan.layouts import layout
from kvyard.plan.measure import measured_this_machine, model_matmul_timings, model_prefill_seconds, timeable
from kvyard.plan.memory import WEIGHT_FORMATS, breakdown
from kvyard.plan.model_spec import from_source
from kvyard.plan.rates import LayerCost, SharedCores, fit_layer_cost, predict
from kvyard.sampling_params import SamplingParams

PREFILL_PROMPTS = 4


def held_weight_bytes(llm: LLM) -> int:
    """Every floating-point weight tensor the engine holds, each once (a tied head is the embedding); not the
    experts' index."""
    seen: dict[int, int] = {}
    for t in llm.engine.runner.model.weight_tensors():
        if t.is_floating_point():
            try:
                key = t.data_ptr()
            except RuntimeError:  # a weight packed into oneDNN's opaque layout (AMX) has no plain storage
                key = id(t)
            seen[key] = t.numel() * t.element_size()
    return sum(seen.values())


def prefill_rate(llm: LLM, prompts: int, length: int, repeats: int = 3) -> float:
    """Prompt tokens a second: `prompts` prompts of `length` tokens, one output token each, the best run."""
    vocab = llm.engine.model_config.vocab_size
    best = float("inf")
    for r in range(repeats):
        # every prompt of every run its own, so that no run finds another's blocks in the prefix cache
        ids = [[(97 + 31 * (r * prompts + i) + 7 * j * (r * prompts + i + 1)) % (vocab - 1) + 1 for j in range(length)]
               for i in range(prompts)]
        start = time.perf_counter()
        llm.generate(ids, SamplingParams(max_tokens=1, temperature=0.0))
        best = min(best, time.perf_counter() - start)
    return prompts * length / best


@functools.cache  # timed once a model: the calibration's fit and the prediction see the same timings
def timings(name: str, batch: int, prefill_len: int) -> tuple[dict[int, float], dict[int, float]]:
    """The model's decode matmuls at batch 1 and `batch`, and its prefill step of PREFILL_PROMPTS prompts."""
    cfg = from_source(name).config
    return (model_matmul_timings(cfg, (1, batch)),
            {PREFILL_PROMPTS * prefill_len: model_prefill_seconds(cfg, PREFILL_PROMPTS, prefill_len)})


def predicted(name: str, dev: Device, copies: int, args: argparse.Namespace, layer_cost: LayerCost | None = None,
              matmuls: dict[int, float] | None = None, tp: int = 1, pp: int = 1,
              shared: SharedCores | None = None) -> dict[str, float]:
    """`matmuls`: the decode steps' matmuls timed otherwise than at this process's threads; `tp`, `pp` and
    `shared`: a layout whose ranks share this machine's cores (kvyard/bench/plan_layouts.py). The weights are
    rank 0's."""
    model = from_source(name)
    cfg = model.config
    # the prefill is one step: the offline token budget holds every prompt
    timed, prefill_s = timings(name, args.batch, args.prefill_len) if timeable(cfg) else (None, None)
    matmuls = matmuls or timed
    out: dict[str, float] = {}
    for batch in (1, args.batch):
        mem = breakdown(cfg, WEIGHT_FORMATS["bfloat16"], args.input_len, batch, size=model.size, packed_copies=copies)
        lo = layout(cfg, mem, dev, tp, pp, 0.9)
        rates = predict(cfg, model.active_params, mem, dev, lo, batch, args.input_len, matmul_s=matmuls,
                        layer_cost=layer_cost, prefill_s=prefill_s, shared=shared)
        out[f"decode_tok_s_batch_{batch}"] = rates.decode_tok_s
    out["prefill_tok_s"] = rates.prefill_tok_s
    out["weight_bytes"] = lo.stage_weights[0]
    return out


def measured(llm: LLM, args: argparse.Namespace) -> dict[str, float]:
    out = {f"decode_tok_s_batch_{batch}": statistics.median(decode_rate(llm, batch, args.input_len, args.steps)
                                                           for _ in range(3)) for batch in (1, args.batch)}
    out["prefill_tok_s"] = prefill_rate(llm, PREFILL_PROMPTS, args.prefill_len)
    out["weight_bytes"] = float(held_weight_bytes(llm))  # after the runs: the head is packed at its first use
    return out


def calibrated_layer_cost(name: str, dev: Device, copies: int, seen: dict[str, float],
                          args: argparse.Namespace, matmuls: dict[int, float] | None = None) -> LayerCost:
    """Each layer's cost outside its matmuls, fitted on `name`'s measured decode steps at batch 1 and --batch."""
    raw = predicted(name, dev, copies, args, matmuls=matmuls)
    steps = {b: (b / raw[f"decode_tok_s_batch_{b}"], b / seen[f"decode_tok_s_batch_{b}"]) for b in (1, args.batch)}
    return fit_layer_cost(from_source(name).config, {b: p for b, (p, _) in steps.items()},
                          {b: m for b, (_, m) in steps.items()})


def plot_errors(rows: list[dict[str, Any]], tolerance: float, path: Path) -> None:
    """Bars of each figure's error (predicted / measured - 1), grouped by model, over the tolerance band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6.0, 0.55 * len(rows) + 2), 4.5))
    errors = [100 * r["error"] for r in rows]
    colours = ["tab:red" if r["drift"] else "tab:grey" if r["fitted_on"] else "tab:blue" for r in rows]
    bars = ax.bar(range(len(rows)), errors, color=colours)
    ax.bar_label(bars, [f"{e:+.1f}%" for e in errors], fontsize=7)
    ax.axhspan(-100 * tolerance, 100 * tolerance, color="tab:green", alpha=0.12,
               label=f"within {tolerance:.0%}")
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(rows)), [f"{r['model']}\n{r['figure'].replace('_tok_s', '').replace('_', ' ')}"
                                     for r in rows], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("predicted / measured - 1 (%)")
    ax.set_title("kvyard plan against the engine on this machine (grey: the calibration's own fit)")
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_plan_bench(args: argparse.Namespace) -> int:
    dev = measured_this_machine()
    print(f"this machine: {dev.bandwidth / 1e9:.1f} GB/s, {dev.flops['bfloat16'] / 1e12:.2f} bf16 TFLOPS (measured)")
    names = args.models.split(",")
    # The calibration model first: its steps fit the layer cost every other model's predictions use.
    order = [args.calibrate_on, *(n for n in names if n != args.calibrate_on)] if args.calibrate_on else names
    rows: list[dict[str, Any]] = []
    cost: LayerCost | None = None
    for name in order:
        llm = LLM(config=EngineConfig(model=name, dtype="bfloat16"))
        copies = packed_copies(llm.engine.runner.model.max_rows)
        seen = measured(llm, args)
        del llm
        if name == args.calibrate_on:
            cost = calibrated_layer_cost(name, dev, copies, seen, args)
            print(f"layer cost outside the matmuls, fitted on {name}: {cost.fixed_s * 1e6:.1f} us + "
                  f"{cost.per_row_hidden_s * 1e9:.2f} ns a row and hidden unit")
            if name not in names:
                continue
        expected = predicted(name, dev, copies, args, cost)
        for figure, value in expected.items():
            error = value / seen[figure] - 1
            rows.append({"model": name, "figure": figure, "predicted": value, "measured": seen[figure],
                         "error": error, "drift": abs(error) > args.tolerance,
                         "fitted_on": name == args.calibrate_on and figure.startswith("decode")})
    syncs, rank_costs = None, {}
    if args.layouts:  # after the single processes: rank 0 binds this process to its share of the cores
        from kvyard.bench.plan_layouts import layout_rows

        layout_figures, syncs, rank_costs = layout_rows(dev, args)
        rows += layout_figures
    stamp = {"time": datetime.now(UTC).isoformat(timespec="seconds"), "machine": machine_info(),
             "bandwidth": dev.bandwidth, "bf16_flops": dev.flops["bfloat16"], "tolerance": args.tolerance,
             "calibrate_on": args.calibrate_on, "layer_cost": asdict(cost) if cost else None, "syncs": syncs,
             "rank_layer_costs": {k: asdict(c) for k, c in rank_costs.items()}}
    record = Path(args.record)
    record.parent.mkdir(parents=True, exist_ok=True)
    with record.open("a") as f:
        for row in rows:
            f.write(json.dumps({**stamp, **row}) + "\n")
    plot_errors(rows, args.tolerance, Path(args.plot) if args.plot else record.parent / "errors.png")
    print(f"{'model':<22} {'figure':<22} {'predicted':>14} {'measured':>14} {'error':>8}")
    for r in rows:
        print(f"{r['model']:<22} {r['figure']:<22} {r['predicted']:>14,.1f} {r['measured']:>14,.1f} "
              f"{r['error']:>+8.1%}{'  DRIFT' if r['drift'] else ''}{'  (fitted here)' if r['fitted_on'] else ''}")
    drifted = [r for r in rows if r["drift"]]
    if drifted:
        print(f"DRIFT: {len(drifted)} of {len(rows)} predictions are off by more than {args.tolerance:.0%} "
              f"(appended to {record})")
    return 1 if drifted else 0


def add_plan_bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="the planner's predictions against this machine's measurements (#38)")
    p.add_argument("--models", default="smollm2-135m", help="comma-separated model names or paths")
    p.add_argument("--input-len", type=int, default=128, help="the context the decode steps run at")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=16, help="decode steps timed a measurement")
    p.add_argument("--prefill-len", type=int, default=512)
    p.add_argument("--tolerance", type=float, default=0.15)
    p.add_argument("--calibrate-on", default="smollm2-135m",
                   help="fit each layer's cost outside the matmuls on this model's decode steps ('' for none); "
                        "its own decode figures are then in sample")
    p.add_argument("--layouts", default="",
                   help="parallel layouts on this machine's cores too, comma-separated MODEL:tpN, MODEL:ppN or "
                        "MODEL:tpNppM (e.g. qwen2.5-coder-0.5b:tp2,smollm2-135m:pp2)")
    p.add_argument("--calibrate-layout-on", default="",
                   help="fit the per-stage-step sync of tensor ranks on a MODEL:tpN layout's decode steps, and of "
                        "pipeline stages on a MODEL:ppN one (comma-separated); their own decode figures are then in "
                        "sample")
    p.add_argument("--record", default=DEFAULT_RECORD, help="the standing record; `kvyard plan --measure` applies "
                                                             "its latest fit made on this CPU")
    p.add_argument("--plot", help="where the PNG of the errors goes (default: errors.png beside the record)")
    p.set_defaults(func=run_plan_bench)
