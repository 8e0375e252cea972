"""`kvyard bench offline`: kvyard against its peers on the same weights and workload, in one run.

The machines are noisy, so the systems take turns for `--repeats` rounds and the report gives the
median of each figure and the ratio of the medians (with every round's ratio next to it).
"""

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from kvyard.bench import openvino_peer, parallel, peers
from kvyard.bench.output import emit_json, machine_info
from kvyard.bench.workload import Workload, random_workload
from kvyard.cli.engine_args import add_engine_args, engine_config_from_args
from kvyard.config import EngineConfig, parse_dtype
from kvyard.llm import LLM
from kvyard.sampling_params import SamplingParams


def add_offline_bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("offline", help="offline throughput and batch-1 latency against HF (and llama.cpp)")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths vary uniformly within ±ratio of --input-len/--output-len")
    p.add_argument("--batch1-requests", type=int, default=2, help="requests run one at a time for batch-1 numbers")
    p.add_argument("--repeats", type=int, default=3, help="rounds; the systems take turns in each")
    p.add_argument("--peers", default="hf", help="comma list of hf, llama.cpp, openvino, or none")
    p.add_argument("--openvino-formats", default="auto",
                   help="OpenVINO IR weight formats run against kvyard (fp16, int8, int4); auto: fp16,int8 against a "
                        "dense kvyard, int4 against --quantization gguf")
    p.add_argument("--openvino-kv-cache", default="match",
                   help="OpenVINO's KV cache precision: match (kvyard's own: the model's dtype, or u8 against "
                        "--kv-cache-dtype int8), default (the pipeline's), or u8, bf16, f16, f32")
    p.add_argument("--hf-in-process", action="store_true",
                   help="run HF in this process (under kvyard's malloc settings) instead of its own")
    p.add_argument("--llama-cpp-gguf", default=None,
                   help="the GGUF file llama.cpp runs (default: the model, when it is a GGUF file), e.g. the source of "
                        "a quantized kvyard directory")
    p.add_argument("--compare-batch-invariant", action="store_true",
                   help="also time the same engine with --batch-invariant, in the same rounds (its cost)")
    p.add_argument("--compare-dynamic-quant", action="store_true",
                   help="also time the same engine with --dynamic-quant (int8 activations), in the same rounds")
    p.add_argument("--json-out", default=None)
    add_engine_args(p)
    p.set_defaults(func=run_offline_bench)


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def kvyard_batch(llm: LLM, work: Workload) -> float:
    """All requests submitted at once; returns output tokens per second."""
    start = time.perf_counter()
    outs = llm.generate(work.prompts, [_greedy(n) for n in work.output_lens])
    elapsed = time.perf_counter() - start
    assert sum(len(o.outputs[0].token_ids) for o in outs) == work.output_tokens
    return work.output_tokens / elapsed


def kvyard_token_ids(llm: LLM, work: Workload) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(work.prompts, [_greedy(n) for n in work.output_lens])]


def greedy_agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """How far two engines' greedy outputs for the same prompts agree: the share of outputs identical token for
    token, and the mean number of tokens before the first difference."""
    prefixes = []
    for a, b in zip(ours, theirs, strict=True):
        same = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        prefixes.append(same)
    identical = sum(a == b for a, b in zip(ours, theirs, strict=True))
    return {"identical_share": identical / len(ours), "mean_common_prefix_tokens": statistics.mean(prefixes)}


def _start_openvino(args: argparse.Namespace, cfg: EngineConfig, llm: LLM,
                    notes: list[str]) -> dict[str, openvino_peer.OpenVINOPeer]:
    if not openvino_peer.installed():
        notes.append("openvino skipped: needs `make openvino-peer`")
        return {}
    formats = openvino_peer.parse_formats(args.openvino_formats, cfg.quantization)
    dirs = openvino_peer.export(cfg.model, formats)
    kv_gb = max(1, round(cfg.kv_cache_memory / 2**30))
    kv_precision = _openvino_kv_precision(args.openvino_kv_cache, cfg)
    return {fmt: openvino_peer.OpenVINOPeer(path, torch.get_num_threads(), llm.engine.scheduler.token_budget, kv_gb,
                                            kv_precision)
            for fmt, path in dirs.items()}


def _openvino_kv_precision(choice: str, cfg: EngineConfig) -> str | None:
    """The KV_CACHE_PRECISION OpenVINO runs with: by default kvyard's own, said out loud, so that neither engine's
    cache is lossier than the other's (u8 rounds every key and value to 8 bits)."""
    if choice == "default":
        return None
    if choice != "match":
        return choice
    if cfg.kv_cache_dtype == "int8":
        return "u8"
    return {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}[parse_dtype(cfg.dtype)]


def _put_batch1(row: dict, system: str, figures: dict) -> None:
    row[f"{system}.batch1.tok_s"], row[f"{system}.batch1.itl_ms"] = figures["output_tokens_per_s"], figures["itl_ms_p50"]


def kvyard_batch1(llm: LLM, work: Workload) -> dict:
    itls: list[float] = []
    start = time.perf_counter()
    for prompt, n in zip(work.prompts, work.output_lens, strict=True):
        last = None
        for _ in llm.stream(prompt, _greedy(n)):
            now = time.perf_counter()
            if last is not None:
                itls.append(now - last)
            last = now
    elapsed = time.perf_counter() - start
    return {"output_tokens_per_s": work.output_tokens / elapsed, "itl_ms_p50": 1000 * statistics.median(itls)}


def _median_summary(rounds: list[dict]) -> dict:
    keys = rounds[0].keys()
    return {k: statistics.median(r[k] for r in rounds) for k in keys}


def _ratios(rounds: list[dict], med: dict) -> dict:
    pairs = {
        "batch_throughput_vs_hf_padded": ("kvyard.batch.tok_s", "hf.batch.tok_s"),
        "batch1_throughput_vs_hf": ("kvyard.batch1.tok_s", "hf.batch1.tok_s"),
        "batch1_itl_vs_llama_cpp": ("kvyard.batch1.itl_ms", "llama.cpp.batch1.itl_ms"),
        "batch1_throughput_vs_llama_cpp": ("kvyard.batch1.tok_s", "llama.cpp.batch1.tok_s"),
        "batch_throughput_vs_tp1": ("kvyard.batch.tok_s", "kvyard-tp1.batch.tok_s"),
        "batch1_throughput_vs_tp1": ("kvyard.batch1.tok_s", "kvyard-tp1.batch1.tok_s"),
        "batch_invariant_batch_throughput": ("kvyard-invariant.batch.tok_s", "kvyard.batch.tok_s"),
        "batch_invariant_batch1_itl": ("kvyard-invariant.batch1.itl_ms", "kvyard.batch1.itl_ms"),
        "dynamic_quant_batch_throughput": ("kvyard-dynamic-quant.batch.tok_s", "kvyard.batch.tok_s"),
        "dynamic_quant_batch1_itl": ("kvyard-dynamic-quant.batch1.itl_ms", "kvyard.batch1.itl_ms"),
    }
    for peer in sorted({k.split(".")[0] for k in med if k.startswith("openvino-")}):
        fmt = peer.removeprefix("openvino-")
        for ours, prefix in (("kvyard", ""), ("kvyard-dynamic-quant", "dynamic_quant_")):
            pairs[f"{prefix}batch_throughput_vs_openvino_{fmt}"] = (f"{ours}.batch.tok_s", f"{peer}.batch.tok_s")
            pairs[f"{prefix}batch1_throughput_vs_openvino_{fmt}"] = (f"{ours}.batch1.tok_s", f"{peer}.batch1.tok_s")
    out = {}
    for name, (a, b) in pairs.items():
        if a in med and b in med:
            out[name] = {"median": med[a] / med[b], "per_round": [round(r[a] / r[b], 3) for r in rounds]}
    return out


def run_offline_bench(args: argparse.Namespace) -> int:
    cfg = engine_config_from_args(args)
    if args.compare_batch_invariant and cfg.batch_invariant is None:  # against the path it replaces, not the default
        cfg = dataclasses.replace(cfg, batch_invariant=False)
    cores = os.sched_getaffinity(0)  # before a parallel replica's rank 0 (this process) binds to its share
    llm = LLM(config=cfg)
    # A parallel replica runs against the same engine on one process, in turns (rank 0 shares this process)
    split = cfg.tensor_parallel_size > 1 or cfg.pipeline_parallel_size > 1
    tp1 = parallel.SingleProcessBaseline(cfg, torch.get_num_threads(), cores) if split else None

    def workload(seed: int) -> tuple[Workload, Workload]:
        # Fresh prompts every round, and batch-1 prompts apart from the batch's: a repeated prompt would
        # let kvyard's prefix cache skip the prefill that HF, which keeps no cache between calls, redoes.
        work = random_workload(llm.tokenizer, args.num_requests + args.batch1_requests, args.input_len,
                               args.output_len, args.range_ratio, seed=seed)
        batch1 = work.prompts[args.num_requests:]
        del work.prompts[args.num_requests:], work.output_lens[args.num_requests:]
        return work, Workload(batch1, [args.output_len] * args.batch1_requests)

    wanted = {p.strip() for p in args.peers.split(",") if p.strip() and p.strip() != "none"}
    hf = None
    pad = llm.tokenizer.pad_token_id if llm.tokenizer.pad_token_id is not None else 0
    if "hf" in wanted:
        hf = peers.HFPeer(llm.engine.model_path, cfg.dtype, torch.get_num_threads(), own_process=not args.hf_in_process)
    lcpp = None
    notes = []
    if "llama.cpp" in wanted:
        gguf = Path(args.llama_cpp_gguf) if args.llama_cpp_gguf else llm.engine.model_path
        python = peers.llama_cpp_python()
        if gguf.suffix == ".gguf" and python is not None:
            lcpp = peers.LlamaCppPeer(gguf, torch.get_num_threads(), python)
        else:
            notes.append("llama.cpp skipped: needs llama-cpp-python (`make peers`) and a GGUF file (--llama-cpp-gguf)")
    ov = _start_openvino(args, cfg, llm, notes) if "openvino" in wanted else {}
    # The same engine with one switch flipped, timed in the same rounds: what the switch costs or gains
    variants = {name: LLM(config=dataclasses.replace(cfg, **{field: True}))
                for name, field, wanted in (("kvyard-invariant", "batch_invariant", args.compare_batch_invariant),
                                            ("kvyard-dynamic-quant", "dynamic_quant", args.compare_dynamic_quant))
                if wanted}
    # Warm-up at full size, so one-time costs (kernel setup per shape, allocator growth) hit no round; its
    # outputs show how far each peer's greedy text agrees with kvyard's.
    warm, _ = workload(seed=args.repeats + 1)
    warm_ids = kvyard_token_ids(llm, warm)
    agreement = {f"openvino-{fmt}": greedy_agreement(warm_ids, peer.batch(warm)[1]) for fmt, peer in ov.items()}
    for name, variant in variants.items():
        agreement[name] = greedy_agreement(warm_ids, kvyard_token_ids(variant, warm))
    if tp1 is not None:
        tp1.run(kvyard_batch, warm)
    if hf is not None:
        hf.static_batch(warm, pad)
    hits_before = llm.engine.blocks.hit_tokens
    comm = parallel.CommCounter(llm) if tp1 is not None else None
    rounds = []
    for r in range(args.repeats):
        work, single = workload(seed=r)
        row: dict[str, float] = {}
        # The engine and its variants take turns going first: with identical kernels on both sides, the one run
        # second in every round measured 0.92-1.02x the throughput and 1.045x the batch-1 ITL (Zen 4, 2026-12-07)
        engines = [("kvyard", llm), *variants.items()]
        for name, engine in engines[:: -1 if r % 2 else 1]:
            row[f"{name}.batch.tok_s"] = kvyard_batch(engine, work)
            _put_batch1(row, name, kvyard_batch1(engine, single))
        if tp1 is not None:
            row["kvyard-tp1.batch.tok_s"] = tp1.run(kvyard_batch, work)
        if hf is not None:
            row["hf.batch.tok_s"] = work.output_tokens / hf.static_batch(work, pad)
        if tp1 is not None:
            _put_batch1(row, "kvyard-tp1", tp1.run(kvyard_batch1, single))
        if hf is not None:
            row["hf.batch1.tok_s"] = single.output_tokens / hf.one_at_a_time(single, pad)
        if lcpp is not None:
            _put_batch1(row, "llama.cpp", lcpp.batch1(single))
        for fmt, peer in ov.items():
            row[f"openvino-{fmt}.batch.tok_s"] = work.output_tokens / peer.batch(work)[0]
            _put_batch1(row, f"openvino-{fmt}", peer.batch1(single))
        print(f"round {r + 1}/{args.repeats}: " + ", ".join(f"{k}={v:.1f}" for k, v in row.items()), file=sys.stderr)
        rounds.append(row)
    layout = None if tp1 is None else parallel.layout_report(llm, tp1, comm)
    if tp1 is not None:
        tp1.close()
    if hf is not None:
        hf.close()
    if lcpp is not None:
        lcpp.close()
    for peer in ov.values():
        peer.close()
    med = _median_summary(rounds)
    result = {
        "model": llm.engine.model_path.name,
        "llama_cpp_gguf": None if lcpp is None else gguf.name,
        "dtype": str(cfg.dtype).removeprefix("torch."),
        "workload": {"num_requests": args.num_requests, "input_len": args.input_len, "output_len": args.output_len,
                     "range_ratio": args.range_ratio, "input_tokens": work.input_tokens,
                     "output_tokens": work.output_tokens, "batch1_requests": args.batch1_requests},
        "machine": machine_info(),
        "engine": {"max_num_batched_tokens": llm.engine.scheduler.token_budget, "block_size": cfg.block_size},
        # Prompt tokens kvyard served from its prefix cache in the timed rounds: 0 keeps the peers even.
        "kvyard_prefix_hit_tokens": llm.engine.blocks.hit_tokens - hits_before,
        "hf_process": None if hf is None else ("shared" if args.hf_in_process else "own"),
        "parallel": layout,
        "greedy_agreement_with_kvyard": agreement,
        "openvino": {fmt: {"ir": str(peer.model_dir), "inference_precision": peer.inference_precision,
                           "kv_cache_precision": peer.kv_cache_precision}
                     for fmt, peer in ov.items()},
        "median": med,
        "ratios": _ratios(rounds, med),
        "rounds": rounds,
        "notes": notes,
    }
    emit_json(result, args.json_out)
    return 0
