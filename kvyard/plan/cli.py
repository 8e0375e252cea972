"""`kvyard plan`: the memory a deployment needs, the fewest devices and the parallel layouts that hold it (#38).

    kvyard plan --model smollm2-135m --hardware this --context 4096 --concurrency 32
    kvyard plan --describe params=2.8e12,layers=61,hidden=7168,heads=128,kv_lora_rank=512,rope_dim=64 \\
        --weights nvfp4 --hardware gb300 --context 131072 --concurrency 8
"""

import argparse
import json
import sys
from dataclasses import asdict, replace
from typing import Any

from kvyard.errors import ConfigError
from kvyard.models.config import ModelConfig
from kvyard.models.linear import packed_copies
from kvyard.parallel.affinity import replica_cpus
from kvyard.plan.calibration import DEFAULT_RECORD, Calibration, latest_calibration
from kvyard.plan.hardware import CATALOGUE, Device, device
from kvyard.plan.layouts import Layout, devices_by_memory, layouts
from kvyard.plan.memory import DTYPES, WEIGHT_FORMATS, breakdown, weight_format
from kvyard.plan.model_spec import DESCRIBE_KEYS, planned_model
from kvyard.plan.rates import predict

GB = 1e9


def _measured(args: argparse.Namespace, cfg: ModelConfig, weights: str
              ) -> tuple[Device, dict[int, float] | None, dict[int, float] | None]:
    """This machine's rates measured now (about half a minute), and where the engine runs the model as dense bf16
    layers, its matmuls timed at its decode shapes and its layers over a prefill step of the token budget. A
    layout of several ranks is then timed as its ranks would run here, sharing the cores
    (kvyard.plan.measure_ranks.shared_cores; no sync fitted: `kvyard bench plan --layouts` measures that)."""
    from kvyard.plan.measure import (
        measured_this_machine,
        model_matmul_timings,
        model_prefill_seconds,
        timeable,
    )

    if args.hardware != "this":
        raise ConfigError("--measure measures this machine: use it with --hardware this", param="measure")
    dev = measured_this_machine()
    if weights != "bfloat16" or not timeable(cfg):
        return dev, None, None
    length = min(args.context, args.max_num_batched_tokens)  # prompts as long as the context, a step's worth
    prompts = max(1, args.max_num_batched_tokens // length)
    return (dev, model_matmul_timings(cfg, (1, args.concurrency)),
            {prompts * length: model_prefill_seconds(cfg, prompts, length)})


def _calibration(args: argparse.Namespace) -> "Calibration | None":
    """The latest fit `kvyard bench plan` recorded on this CPU; without one, predictions leave out what a step
    costs outside its matmuls (and a layout's syncs), and say so."""
    from kvyard.bench.output import machine_info

    fitted = latest_calibration(args.calibration, machine_info().get("cpu"))
    if fitted is None:
        print(f"no calibration for this CPU in {args.calibration}: the predictions leave out each layer's cost "
              "outside its matmuls (run kvyard bench plan --layouts ... to fit it)", file=sys.stderr)
    return fitted


def run_plan(args: argparse.Namespace) -> int:
    fmt, dev = weight_format(args.weights), device(args.hardware)
    model = planned_model(args.model, args.describe)
    timings = prefill_s = None
    if args.measure:
        dev, timings, prefill_s = _measured(args, model.config, fmt.name)
    # On this machine the engine's own packing decides how many copies of the dense weights it holds.
    copies = packed_copies(args.max_num_batched_tokens, DTYPES[args.dtype]) if dev.name == "this" else 0
    mem = breakdown(model.config, fmt, args.context, args.concurrency, args.kv_dtype, args.dtype,
                    args.max_num_batched_tokens, model.size, copies)
    fits = [lo for lo in layouts(model.config, mem, dev, args.max_devices, args.memory_utilization) if lo.fits]
    need = [lo for lo in fits if lo.kv_tokens >= args.context * args.concurrency]
    fitted = _calibration(args) if args.measure else None
    rates = {}
    for lo in fits[:args.top] if dev.bandwidth else []:
        shared, cost = None, fitted.layer_cost_of(lo, len(replica_cpus()) // lo.devices) if fitted else None
        if args.measure and lo.devices > 1:  # its ranks would share this machine's cores: time them doing so
            if timings is None or lo.devices > len(replica_cpus()):
                continue  # not timeable here, or more ranks than cores to bind them to
            from kvyard.plan.measure_ranks import shared_cores

            shared = shared_cores(model.config, lo.tp, lo.pp, args.concurrency, max(prefill_s or {1: 1}))
            shared = replace(shared, **(fitted.syncs if fitted else {}))
        rates[(lo.tp, lo.pp)] = {f"batch_{b}": asdict(predict(
            model.config, model.active_params, mem, dev, lo, b, args.context, args.weights_compute, matmul_s=timings,
            layer_cost=cost, prefill_s=prefill_s, shared=shared)) for b in (1, args.concurrency)}
    if rates:  # the layouts that hold the target KV, fastest at the target concurrency first
        def speed(lo: Layout) -> float:
            return rates[(lo.tp, lo.pp)][f"batch_{args.concurrency}"]["decode_tok_s"] if (lo.tp, lo.pp) in rates \
                else 0.0
        need.sort(key=lambda lo: (-speed(lo), lo.devices))
    report: dict[str, Any] = {
        "model": model.name, "params": model.size.params, "weights_format": fmt.name, "device": dev.name,
        "memory": {**asdict(mem), "total": mem.total},
        "devices_by_memory": devices_by_memory(mem, dev, args.memory_utilization),
        "layouts": [{**asdict(lo), "devices": lo.devices, "kv_tokens": lo.kv_tokens,
                     "predicted": rates.get((lo.tp, lo.pp))} for lo in fits[:args.top]],
        "best": None if not need else {"tp": need[0].tp, "pp": need[0].pp, "flags": _flags(args, need[0].tp,
                                                                                             need[0].pp)},
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print(report, args)
    return 0 if need else 1


def _flags(args: argparse.Namespace, tp: int, pp: int) -> str:
    flags = [f"--model {args.model}" if args.model else "--model MODEL"]
    flags += [f"--tensor-parallel-size {tp}"] if tp > 1 else []
    flags += [f"--pipeline-parallel-size {pp}"] if pp > 1 else []
    flags += [f"--kv-cache-dtype {args.kv_dtype}"] if args.kv_dtype != "auto" else []
    flags += [f"--max-num-seqs {args.concurrency}", f"--max-model-len {args.context}"]
    return "kvyard serve " + " ".join(flags)


def _print(r: dict[str, Any], args: argparse.Namespace) -> None:
    m = r["memory"]
    print(f"{r['model']}: {r['params'] / 1e9:.4g} B parameters, weights in {r['weights_format']}, on {r['device']}")
    print(f"  weights      {m['weights'] / GB:10.2f} GB (of which scales {m['weight_scales'] / GB:.2f} GB)")
    print(f"  KV per token {m['kv_per_token']:10,d} B")
    print(f"  KV target    {m['kv_total'] / GB:10.2f} GB ({args.concurrency} x {args.context:,} tokens)")
    print(f"  activations  {m['activations'] / GB:10.2f} GB a rank ({args.max_num_batched_tokens} batched tokens)")
    print(f"  fewest devices by memory: {r['devices_by_memory']} (at {args.memory_utilization:.0%} of each)")
    print("  layouts that hold the weights (tp x pp: devices, KV headroom in tokens):")
    for lo in r["layouts"]:
        enough = "" if lo["kv_tokens"] >= args.concurrency * args.context else "  (less than the target)"
        print(f"    tp {lo['tp']} x pp {lo['pp']}: {lo['devices']:3d} devices, {lo['kv_tokens']:>14,d} tokens, "
              f"{lo['weights_per_device'] / GB:.2f} GB weights a device{enough}")
        if lo["predicted"]:
            one, many = lo["predicted"]["batch_1"], lo["predicted"][f"batch_{args.concurrency}"]
            print(f"      predicted: decode {one['decode_tok_s']:,.0f} tok/s at batch 1 (ITL "
                  f"{one['decode_step_s'] * 1e3:.2f} ms), {many['decode_tok_s']:,.0f} at {args.concurrency} "
                  f"({many['bound']}-bound), prefill {one['prefill_tok_s']:,.0f} tok/s")
    if r["best"] is None:
        print(f"  no layout of up to {args.max_devices} devices holds the target KV")
    else:
        print(f"  best: tp {r['best']['tp']} x pp {r['best']['pp']} (holds the target KV; the fastest predicted where "
              f"rates are known, else the fewest devices)\n  run: {r['best']['flags']}")


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="memory, fewest devices and parallel layouts for a model and a workload")
    p.add_argument("--model", default=None, help="a known model name, a checkpoint directory, a config.json or a "
                                                 "GGUF file")
    p.add_argument("--describe", default=None,
                   help=f"a model not on disk, as key=value pairs of {', '.join(sorted(DESCRIBE_KEYS))}")
    p.add_argument("--weights", default="bfloat16", help=f"weight format: {', '.join(WEIGHT_FORMATS)}")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="compute dtype (activations, and the KV cache unless --kv-dtype int8)")
    p.add_argument("--kv-dtype", default="auto", choices=["auto", "int8"])
    p.add_argument("--weights-compute", default="bfloat16",
                   help="the FLOPs the predictions assume the weights compute at (bfloat16, fp8, nvfp4)")
    p.add_argument("--hardware", default="this", help=f"device: {', '.join([*CATALOGUE, 'this'])}")
    p.add_argument("--context", type=int, default=4096, help="tokens a sequence reaches (prompt and output)")
    p.add_argument("--concurrency", type=int, default=32, help="sequences running at once")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--memory-utilization", type=float, default=0.9, help="share of each device's memory for kvyard")
    p.add_argument("--max-devices", type=int, default=8)
    p.add_argument("--top", type=int, default=8, help="how many fitting layouts to list")
    p.add_argument("--measure", action="store_true",
                   help="with --hardware this: measure this machine's rates and the model's matmuls, and predict rates")
    p.add_argument("--calibration", default=DEFAULT_RECORD,
                   help="with --measure: apply the latest fit `kvyard bench plan` recorded here on this CPU")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run_plan)
