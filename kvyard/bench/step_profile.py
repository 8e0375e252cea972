"""`kvyard bench step-profile`: where one loaded engine step's time goes, and the machine's matmul floor.

The step is the one a server runs at concurrency 64 under the issue's workload: 64 streams decoding at about
200 tokens of context, and a new prompt's chunk beside them. torch's profiler splits it by the engine's phases
(kvyard.schedule, .prepare, .forward, .sample, .emit: record_function markers in LLMEngine.step) and the
forward pass by operator: matmuls, attention, the other kernels, and the Python between them. A plain bf16 GEMM
of the step's own shapes, and a large square one, timed in the same run, give the matmul rate this CPU reaches:
the compute floor the step's matmul FLOPs set.

HTTP is not in the step: a server's `kvyard_engine_step_seconds` against wall time gives the engine thread's
busy share, the rest going to the event loop, queues and the GIL.
"""

import argparse
import random
import sys
import time
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from kvyard.bench.output import emit_json, machine_info
from kvyard.config import EngineConfig
from kvyard.engine.llm_engine import LLMEngine
from kvyard.sampling_params import SamplingParams

PHASES = ("kvyard.schedule", "kvyard.prepare", "kvyard.forward", "kvyard.sample", "kvyard.emit")
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear")


def add_step_profile_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("step-profile", help="one loaded step split by phase and operator; the matmul floor")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--decodes", type=int, default=64, help="streams decoding in the step")
    p.add_argument("--context", type=int, default=200, help="their context, in tokens")
    p.add_argument("--prompt-chunk", type=int, default=128,
                   help="a new prompt's tokens in the same step (0: decode steps only)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantization", default=None, help="as kvyard serve's (gguf, int8, ...)")
    p.add_argument("--dynamic-quant", action="store_true", help="as kvyard serve's")
    p.add_argument("--steps", type=int, default=20, help="steps timed, then as many profiled (after 3 to warm up)")
    p.add_argument("--json-out", default=None)
    p.set_defaults(func=run_step_profile)


def category(op: str) -> str:
    if "attention" in op:
        return "attention"
    if op in MATMUL_OPS or "linear" in op:
        return "matmul"
    return "other kernels"


def loaded_engine(args: argparse.Namespace) -> LLMEngine:
    """An engine with `decodes` streams past their prefill; no inter-token target, so every step has the shape."""
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, quantization=args.quantization,
                                    dynamic_quant=args.dynamic_quant, max_itl_ms=0, max_num_seqs=args.decodes + 1))
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=10_000, ignore_eos=True, temperature=0)
    for _ in range(args.decodes):
        engine.add_request([rng.randrange(vocab) for _ in range(args.context)], params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    return engine


def loaded_steps(engine: LLMEngine, args: argparse.Namespace, count: int, rng: random.Random) -> None:
    """`count` steps, each with every stream decoding and one fresh prompt of `prompt_chunk` tokens."""
    vocab = engine.model_config.vocab_size
    for _ in range(count):
        if args.prompt_chunk:
            engine.add_request([rng.randrange(vocab) for _ in range(args.prompt_chunk)], SamplingParams(max_tokens=1))
        engine.step()


def gemm_tflops(m: int, k: int, n: int, seconds: float = 1.0) -> float:
    """bf16 TFLOP/s of torch.mm at (m x k) @ (k x n), run for about `seconds`."""
    a, b = torch.randn(m, k, dtype=torch.bfloat16), torch.randn(k, n, dtype=torch.bfloat16)
    torch.mm(a, b)
    runs, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        torch.mm(a, b)
        runs += 1
    return 2 * m * k * n * runs / (time.perf_counter() - t0) / 1e12


def matmul_flops(engine: LLMEngine, tokens: int, sampled: int) -> float:
    """FLOPs of one step's matmuls: every linear layer over `tokens` rows, the LM head over `sampled` rows."""
    cfg = engine.model_config
    qkv = cfg.hidden_size * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    per_layer = qkv + cfg.num_heads * cfg.head_dim * cfg.hidden_size + 3 * cfg.hidden_size * cfg.intermediate_size
    return 2.0 * (tokens * per_layer * cfg.num_layers + sampled * cfg.hidden_size * cfg.vocab_size)


def run_step_profile(args: argparse.Namespace) -> int:
    engine = loaded_engine(args)
    rng = random.Random(1)
    loaded_steps(engine, args, 3, rng)  # warm: kernel caches, a few prompt shapes
    # The profiler costs more per operator than some operators take: the step's own time comes from plain runs.
    t0 = time.perf_counter()
    loaded_steps(engine, args, args.steps, rng)
    wall_ms = 1000 * (time.perf_counter() - t0) / args.steps
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        loaded_steps(engine, args, args.steps, rng)
    events = prof.key_averages()
    phases = {e.key.removeprefix("kvyard."): e.cpu_time_total / 1000 / args.steps for e in events if e.key in PHASES}
    ops: dict[str, float] = {}
    for e in events:
        if not e.key.startswith("kvyard.") and e.self_cpu_time_total > 0:  # operators, not the phase markers
            ops[category(e.key)] = ops.get(category(e.key), 0.0) + e.self_cpu_time_total / 1000 / args.steps
    split = {name: round(ms, 2) for name, ms in sorted(ops.items())}
    split["python and the rest"] = round(max(0.0, wall_ms - sum(ops.values())), 2)
    tokens = args.decodes + args.prompt_chunk
    flops = matmul_flops(engine, tokens, args.decodes + (1 if args.prompt_chunk else 0))
    cfg = engine.model_config
    gemm = {"plain_gemm_tflops_step_shape": gemm_tflops(tokens, cfg.hidden_size, cfg.intermediate_size),
            "plain_gemm_tflops_2048": gemm_tflops(2048, 2048, 2048)}
    best = max(gemm.values())
    report: dict[str, Any] = {
        "benchmark": "step-profile", "model": args.model, "machine": machine_info(),
        "step": {"decodes": args.decodes, "context": args.context, "prompt_chunk": args.prompt_chunk,
                 "tokens": tokens, "profiled_steps": args.steps},
        "step_ms": round(wall_ms, 2),
        "phases_ms": {k: round(v, 2) for k, v in phases.items()},
        "by_kind_ms": split,
        "matmul": {
            "gflop_per_step": flops / 1e9,
            "achieved_tflops": flops / (ops["matmul"] / 1000) / 1e12 if ops.get("matmul") else None,
            **gemm,
            "floor_ms": flops / (best * 1e12) * 1000,  # the step's matmuls at the plain GEMM's best rate
        },
    }
    emit_json(report, args.json_out)
    print(f"step {wall_ms:.1f} ms: " + ", ".join(f"{k} {v:.1f}" for k, v in split.items())
          + f"; matmuls {flops / 1e9:.1f} GFLOP, floor {report['matmul']['floor_ms']:.1f} ms at {best:.2f} TFLOP/s",
          file=sys.stderr)
    return 0
