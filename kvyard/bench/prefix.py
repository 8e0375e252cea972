"""`kvyard bench prefix`: time to first token of a long prompt whose prefix is cached, against cold."""

import argparse
import statistics
import sys
import time

from kvyard.bench.output import emit_json
from kvyard.bench.workload import random_workload
from kvyard.cli.engine_args import add_engine_args, engine_config_from_args
from kvyard.llm import LLM
from kvyard.sampling_params import SamplingParams


def add_prefix_bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("prefix", help="TTFT with a cached prompt prefix against the same prompt cold")
    p.add_argument("--prompt-len", type=int, default=2000)
    p.add_argument("--cached-len", type=int, default=1900, help="leading tokens shared with an earlier request")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json-out", default=None)
    add_engine_args(p)
    p.set_defaults(func=run_prefix_bench)


def ttft(llm: LLM, prompt: list[int]) -> float:
    start = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))[0]
    elapsed = time.perf_counter() - start
    if out.outputs[0].finish_reason != "length":
        raise RuntimeError(f"benchmark request failed: finish_reason={out.outputs[0].finish_reason}")
    return elapsed


def run_prefix_bench(args: argparse.Namespace) -> int:
    cfg = engine_config_from_args(args, enable_prefix_caching=True)
    llm = LLM(config=cfg)
    # Each round: a "seed" prompt fills the cache; the measured prompt shares its first cached_len tokens.
    base = random_workload(llm.tokenizer, 2 * args.repeats + 1, args.prompt_len, 1, seed=1).prompts
    ttft(llm, base[-1][:64])  # warm-up
    rounds = []
    for r in range(args.repeats):
        seed, fresh = base[2 * r], base[2 * r + 1]
        measured = seed[: args.cached_len] + fresh[args.cached_len :]
        cold = ttft(llm, fresh)  # nothing of it is cached
        ttft(llm, seed)
        hit_before = llm.engine.blocks.hit_tokens
        warm = ttft(llm, measured)
        hit = llm.engine.blocks.hit_tokens - hit_before
        rounds.append({"cold_ms": 1000 * cold, "cached_ms": 1000 * warm, "hit_tokens": hit})
        print(f"round {r + 1}: cold {1000 * cold:.0f} ms, cached {1000 * warm:.0f} ms ({hit} tokens hit)",
              file=sys.stderr)
    cold_ms = statistics.median(r["cold_ms"] for r in rounds)
    cached_ms = statistics.median(r["cached_ms"] for r in rounds)
    result = {
        "model": llm.engine.model_path.name, "dtype": str(cfg.dtype).removeprefix("torch."),
        "prompt_len": args.prompt_len, "cached_len": args.cached_len, "block_size": cfg.block_size,
        "max_num_batched_tokens": llm.engine.scheduler.token_budget,
        "ttft_cold_ms": cold_ms, "ttft_cached_ms": cached_ms, "speedup": cold_ms / cached_ms, "rounds": rounds,
    }
    emit_json(result, args.json_out)
    return 0
