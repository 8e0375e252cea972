"""`kvyard bench structured`: what grammar-constrained decoding costs per token, and compile times.

Constrained and unconstrained batches take turns over `--repeats` rounds in one engine. The figure is
the median decode step time while every request of the batch is still running (the inter-token
latency each of them sees), measured after all prompts are prefilled.
"""

import argparse
import statistics
import sys
import time

import torch

from kvyard.bench.decode_steps import timed_decode_steps
from kvyard.bench.output import emit_json
from kvyard.config import EngineConfig
from kvyard.llm import LLM
from kvyard.sampling_params import SamplingParams
from kvyard.structured.spec import StructuredOutput

# Long enough output that a batch stays whole for the timed steps: a list of records.
SCHEMA = {
    "type": "object",
    "properties": {
        "people": {
            "type": "array",
            "minItems": 8,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                    "city": {"type": "string"},
                    "role": {"enum": ["engineer", "teacher", "doctor", "artist"]},
                },
                "required": ["name", "age", "city", "role"],
            },
        }
    },
    "required": ["people"],
}
PROMPT = "List eight people as JSON, with their name, age, city and role."


def add_structured_bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("structured", help="constrained vs unconstrained inter-token latency; grammar compile time")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--steps", type=int, default=24, help="timed decode steps per measurement")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--json-out", default=None)
    p.set_defaults(func=run_structured_bench)


def step_times(llm: LLM, batch: int, steps: int, constrained: bool) -> list[float]:
    spec = StructuredOutput.json_schema(SCHEMA) if constrained else None
    # A constrained request gets room to finish its record: a budget below the schema's shortest answer is a
    # 400, and one near it would time the steering to close rather than the grammar's mask.
    budget = steps + 16 + (256 if constrained else 0)
    params = SamplingParams(max_tokens=budget, temperature=0.0, ignore_eos=not constrained, structured_output=spec)
    prompt = llm.chat_prompt([{"role": "user", "content": PROMPT}])
    return timed_decode_steps(llm, [prompt] * batch, params, steps)


def compile_times(llm: LLM) -> dict[str, float]:
    from kvyard.structured.compiler import GrammarCompiler

    t0 = time.perf_counter()
    compiler = GrammarCompiler(llm.tokenizer, llm.engine.model_config.vocab_size, llm.engine.eos_token_ids)
    t1 = time.perf_counter()
    compiler.compile(StructuredOutput.json_schema(SCHEMA))
    t2 = time.perf_counter()
    compiler.compile(StructuredOutput.json_schema(SCHEMA))
    t3 = time.perf_counter()
    return {"tokenizer_info_ms": 1000 * (t1 - t0), "first_compile_ms": 1000 * (t2 - t1),
            "cached_compile_ms": 1000 * (t3 - t2)}


def run_structured_bench(args: argparse.Namespace) -> int:
    llm = LLM(config=EngineConfig(model=args.model, dtype=args.dtype))
    batches = [int(b) for b in args.batch_sizes.split(",")]
    compile_ms = compile_times(llm)
    step_times(llm, 1, 4, constrained=True)  # warm-up, and the engine's grammar compiler
    rounds = []
    for r in range(args.repeats):
        row = {}
        for b in batches:
            for constrained in (False, True):
                t = step_times(llm, b, args.steps, constrained)
                row[f"b{b}.{'constrained' if constrained else 'plain'}.itl_ms"] = 1000 * statistics.median(t)
        print(f"round {r + 1}: " + ", ".join(f"{k}={v:.1f}" for k, v in row.items()), file=sys.stderr)
        rounds.append(row)
    med = {k: statistics.median(rd[k] for rd in rounds) for k in rounds[0]}
    overhead = {
        f"b{b}": {
            "median": med[f"b{b}.constrained.itl_ms"] / med[f"b{b}.plain.itl_ms"] - 1,
            "per_round": [round(rd[f"b{b}.constrained.itl_ms"] / rd[f"b{b}.plain.itl_ms"] - 1, 3) for rd in rounds],
        }
        for b in batches
    }
    result = {"model": llm.engine.model_path.name, "dtype": args.dtype, "threads": torch.get_num_threads(),
              "steps": args.steps, "median_itl_ms": med, "itl_overhead": overhead, "compile": compile_ms,
              "rounds": rounds}
    emit_json(result, args.json_out)
    return 0
