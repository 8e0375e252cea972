"""`kvyard bench kv-transfer`: KV transfer throughput (blocks, layers, shm) against raw loopback TCP.

The layout comes from a real model's config, so the frame sizes and counts are those a prefill worker of
that model would send for a `--tokens`-long prompt.
"""

import argparse
import sys

from kvyard.bench.output import emit_json
from kvyard.config import parse_dtype
from kvyard.disagg.bandwidth import MODES, run_transfer_bench
from kvyard.disagg.layout import KVLayout
from kvyard.loader.checkpoint import load_checkpoint
from kvyard.loader.registry import resolve_model


def add_kv_transfer_bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("kv-transfer", help="KV transfer throughput (KVSource -> KVFetcher) against loopback TCP")
    p.add_argument("--model", default="smollm2-135m", help="a known model name, HF directory or .gguf file")
    p.add_argument("--tokens", type=int, default=2000, help="prompt tokens whose KV one transfer moves")
    p.add_argument("--repeats", type=int, default=5, help="measured rounds (after one warm-up)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16", help="KV dtype when --kv-cache-dtype is auto")
    p.add_argument("--kv-cache-dtype", choices=("auto", "int8"), default="auto")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--json-out", default=None)
    p.set_defaults(func=run_kv_transfer_bench)


def run_kv_transfer_bench(args: argparse.Namespace) -> int:
    modes = tuple(m for m in args.modes.split(",") if m)
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        print(f"kvyard: error: --modes: unknown {unknown}; choose from {', '.join(MODES)}", file=sys.stderr)
        return 2
    if args.tokens < 1 or args.repeats < 1:
        print("kvyard: error: --tokens and --repeats must be >= 1", file=sys.stderr)
        return 2
    cfg = load_checkpoint(resolve_model(args.model)).config
    int8 = args.kv_cache_dtype == "int8"
    dtype = "int8" if int8 else str(parse_dtype(args.dtype)).removeprefix("torch.")
    layout = KVLayout(num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                      block_size=args.block_size, dtype=dtype, quantized=int8)
    result = {"model": args.model, **run_transfer_bench(layout, args.tokens, args.repeats, modes)}
    emit_json(result, args.json_out)
    return 0
