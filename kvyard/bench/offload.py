"""`kvyard bench offload`: KV offload tiers against none, each comparison in one run.

- working-set: conversations whose histories together hold about four times the engine's KV pool, turn after
  turn; each turn's prompt is the history so far. TTFT p50 and throughput with each tier against no tier.
- restart: a worker with the disk tier has seen a long prompt; a new worker on the same directory answers it
  again, against a cold worker without tiers.
- no-reuse: prompts that share nothing, through a small pool, with the tiers writing every evicted block: the
  cost of writing, as throughput against no tier; and the disk with admission by reuse (`disk+admit2`), which
  writes none of them.
- decision: prompts of each length bucket, all on disk, answered by a restarted worker with the load-or-
  recompute decision on (auto), forced to load, and forced to recompute; TTFT p50 per bucket. From the real
  disk, and from simulated slow remote tiers (the disk with a fixed delay added to every block read, by default
  1.4 and 2 times the engine's own cost of recomputing a block), where loading loses to recomputing for short
  prompts (and at 2x for all).
- overlap: streams decode while long prompts' blocks are loaded from the disk, with the loads on the reader
  thread against the engine waiting for them (offload_overlap.py).
"""

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvyard.bench.output import emit_json
from kvyard.cli.engine_args import add_engine_args, engine_config_from_args
from kvyard.engine.kv_cache import bytes_per_block
from kvyard.llm import LLM
from kvyard.loader.checkpoint import load_checkpoint
from kvyard.loader.registry import resolve_model
from kvyard.sampling_params import SamplingParams

SCENARIOS = ("working-set", "restart", "no-reuse", "decision", "overlap")
DECISION_MODES = ("auto", "load", "recompute")
SLOW_TIER_FACTORS = (1.4, 2.0)  # simulated slow tiers: seconds per block read, against recomputing a block


def add_offload_bench_parser(sub: argparse._SubParsersAction) -> None:
    from kvyard.bench.offload_overlap import add_overlap_args

    p = sub.add_parser("offload", help="KV offload tiers against none: working set, restart, no reuse")
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--tiers", default="host,disk", help="tiers to compare with none: host, disk, redis")
    p.add_argument("--redis-url", default=None, help="redis:// URL for the redis tier")
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--history-len", type=int, default=1000)
    p.add_argument("--user-len", type=int, default=32, help="tokens each later turn adds to the history")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--pool-fraction", type=float, default=0.25, help="the KV pool against the whole working set")
    p.add_argument("--restart-prompt-len", type=int, default=2000)
    p.add_argument("--no-reuse-requests", type=int, default=64)
    p.add_argument("--no-reuse-prompt-len", type=int, default=512)
    p.add_argument("--no-reuse-rounds", type=int, default=2, help="runs of each configuration, alternating")
    p.add_argument("--decision-buckets", default="128,512,2048", help="prompt lengths of the decision scenario")
    p.add_argument("--decision-prompts", type=int, default=4, help="prompts per bucket")
    p.add_argument("--decision-rounds", type=int, default=2, help="runs of each mode, alternating; the best counts")
    p.add_argument("--slow-tier-ms", default=None,
                   help="delays per block read of simulated slow tiers, comma-separated (default: 1.4 and 2 times "
                        "the engine's cost of recomputing a block)")
    add_overlap_args(p)
    p.add_argument("--plot-out", default=None, help="PNG of TTFT p50 by tier (working set)")
    p.add_argument("--json-out", default=None)
    add_engine_args(p)
    p.set_defaults(func=run_offload_bench)


def _tier_options(tier: str, workdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    if "+admit" in tier:  # e.g. disk+admit2: that tier, writing only blocks that 2 prompts carried
        base, after = tier.split("+admit")
        return {**_tier_options(base, workdir, args), "kv_offload_admit_after": int(after)}
    if tier == "none":
        return {}
    if tier == "host":
        return {"kv_offload_host_memory": "8GiB", "kv_offload_host_segment": "off"}  # each run starts empty
    if tier == "disk":
        return {"kv_offload_disk": str(workdir / "disk"), "kv_offload_disk_capacity": "16GiB"}
    if tier == "redis":
        if not args.redis_url:
            raise SystemExit("--tiers redis needs --redis-url")
        return {"kv_offload_redis": args.redis_url}
    raise SystemExit(f"unknown tier {tier!r}: choose host, disk, redis")


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    """Random token ids past the first few (special tokens live there in most vocabularies)."""
    return [rng.randrange(min(100, vocab // 4), min(40000, vocab)) for _ in range(n)]


def _llm(args: argparse.Namespace, **overrides: Any) -> LLM:
    return LLM(config=engine_config_from_args(args, enable_prefix_caching=True, **overrides))


def _run_batch(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[list[list[int]], list[float]]:
    """All prompts at once; their outputs and TTFTs (arrival to first token) in seconds."""
    engine = llm.engine
    ids = [engine.add_request(p, params) for p in prompts]
    tracked = {rid: engine._tracked[rid].req for rid in ids}
    outs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = list(out.outputs[0].token_ids)
    ttfts = [r.first_token_time - r.arrival_time for r in tracked.values()]  # type: ignore[operator]
    return [outs[rid] for rid in ids], ttfts


def _working_set(args: argparse.Namespace, tiers: list[str], per_token: float, vocab: int, workdir: Path
                 ) -> dict[str, Any]:
    rng = random.Random(0)
    total = args.conversations * (args.history_len + args.turns * (args.user_len + args.output_len))
    pool = int(total * args.pool_fraction * per_token)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    histories0 = [_tokens(rng, args.history_len, vocab) for _ in range(args.conversations)]
    users = [[_tokens(rng, args.user_len, vocab) for _ in range(args.turns)] for _ in range(args.conversations)]
    results = {}
    for tier in ["none", *tiers]:
        llm = _llm(args, kv_cache_memory=pool, **_tier_options(tier, workdir / f"ws-{tier}", args))
        _clear_shared(llm)  # blocks an earlier run left in Redis
        _run_batch(llm, [[1, 2, 3]], SamplingParams(max_tokens=2))  # warm-up
        histories = [list(h) for h in histories0]
        ttfts: list[float] = []
        generated = 0
        started = time.perf_counter()
        for turn in range(args.turns):
            prompts = [h + users[c][turn] if turn else h for c, h in enumerate(histories)]
            outs, t = _run_batch(llm, prompts, params)
            ttfts += t if turn else []  # the first turn is cold for every configuration
            generated += sum(map(len, outs))
            histories = [p + o for p, o in zip(prompts, outs, strict=True)]
        elapsed = time.perf_counter() - started
        offload = llm.engine.offload
        results[tier] = {"ttft_p50_ms": 1000 * statistics.median(ttfts), "throughput_tok_s": generated / elapsed,
                         "seconds": elapsed, "hit_tokens": llm.engine.blocks.hit_tokens,
                         "tiers": offload.snapshot() if offload else {}}
        print(f"working-set {tier}: TTFT p50 {results[tier]['ttft_p50_ms']:.0f} ms, "
              f"{results[tier]['throughput_tok_s']:.1f} tok/s, {llm.engine.blocks.hit_tokens} hit tokens",
              file=sys.stderr)
        if offload:
            offload.close()
    base = results["none"]
    for tier in tiers:
        results[tier]["ttft_gain"] = base["ttft_p50_ms"] / results[tier]["ttft_p50_ms"]
        results[tier]["throughput_ratio"] = results[tier]["throughput_tok_s"] / base["throughput_tok_s"]
    return {"pool_bytes": pool, "working_set_tokens": total, "by_tier": results}


def _ttft(llm: LLM, prompt: list[int]) -> float:
    started = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    return time.perf_counter() - started


def _restart(args: argparse.Namespace, vocab: int, workdir: Path) -> dict[str, Any]:
    prompt = _tokens(random.Random(1), args.restart_prompt_len, vocab)
    disk = {"kv_offload_disk": str(workdir / "restart"), "kv_offload_write": "through"}
    first = _llm(args, **disk)
    warm_up = prompt[:3]
    _ttft(first, warm_up)
    _ttft(first, prompt)
    first.engine.offload.flush()  # type: ignore[union-attr]
    first.engine.offload.close()  # type: ignore[union-attr]
    cold_llm = _llm(args)
    _ttft(cold_llm, warm_up)
    cold = _ttft(cold_llm, prompt)
    restarted = _llm(args, **disk)
    _ttft(restarted, warm_up)
    warm = _ttft(restarted, prompt)
    restored = restarted.engine.offload.restored_blocks  # type: ignore[union-attr]
    print(f"restart: cold {1000 * cold:.0f} ms, from disk after a restart {1000 * warm:.0f} ms "
          f"({restored} blocks restored)", file=sys.stderr)
    return {"prompt_len": len(prompt), "cold_ms": 1000 * cold, "restarted_ms": 1000 * warm,
            "gain": cold / warm, "restored_blocks": restored}


def _redis_tier(llm: LLM) -> Any:
    from kvyard.offload.redis_tier import RedisTier

    return next((t for t in (llm.engine.offload.tiers if llm.engine.offload else []) if isinstance(t, RedisTier)),
                None)


def _clear_shared(llm: LLM) -> None:
    if (tier := _redis_tier(llm)) is not None:
        tier.clear()


def _redis_server_cpu_s(llm: LLM) -> float:
    """CPU seconds the Redis server behind the tier has used so far (its INFO); 0 without a Redis tier. On a
    machine that also runs the engine, what the server takes is what the forward pass loses."""
    if (tier := _redis_tier(llm)) is None:
        return 0.0
    cpu = tier.client.info("cpu")
    return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


def _no_reuse(args: argparse.Namespace, tiers: list[str], per_token: float, vocab: int, workdir: Path
              ) -> dict[str, Any]:
    rng = random.Random(2)
    n = args.no_reuse_prompt_len
    prompts = [_tokens(rng, n, vocab) for _ in range(args.no_reuse_requests)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    pool = int(8 * (n + args.output_len) * per_token)  # eight requests' worth: every later one evicts
    results: dict[str, dict[str, float]] = {}
    for round_ in range(args.no_reuse_rounds):  # configurations alternate; each keeps its best round (order noise)
        for tier in ["none", *tiers, *(f"{t}+admit2" for t in tiers if t == "disk")]:
            llm = _llm(args, kv_cache_memory=pool, **_tier_options(tier, workdir / f"nr-{tier}-{round_}", args))
            _clear_shared(llm)  # an earlier round's blocks in Redis would be reuse
            _run_batch(llm, [[1, 2, 3]], SamplingParams(max_tokens=2))
            server_cpu, own_cpu, started = _redis_server_cpu_s(llm), time.process_time(), time.perf_counter()
            outs, _ = _run_batch(llm, prompts, params)
            if llm.engine.offload:
                llm.engine.offload.flush()
            wall = time.perf_counter() - started
            rate = sum(map(len, outs)) / wall
            # Where the machine's time went: this process (engine and writer threads), and a local Redis server
            tiers_on = llm.engine.offload.tiers if llm.engine.offload else []
            writers = [t.writer.cpu_s for t in tiers_on if hasattr(t, "writer")]  # the host tier copies inline
            cpu = {"wall_s": wall, "process_cpu_s": time.process_time() - own_cpu, "writer_cpu_s": sum(writers),
                   "redis_server_cpu_s": _redis_server_cpu_s(llm) - server_cpu}
            r = results.setdefault(tier, {"rounds": [], "cpu": []})
            r["rounds"].append(rate)
            r["cpu"].append(cpu)
            r["throughput_tok_s"] = max(r["rounds"])
            print(f"no-reuse {tier} round {round_ + 1}: {rate:.1f} tok/s; CPU s: this process "
                  f"{cpu['process_cpu_s']:.1f}, its writer thread {cpu['writer_cpu_s']:.2f}, Redis server "
                  f"{cpu['redis_server_cpu_s']:.2f} in {wall:.1f} s",
                  file=sys.stderr)
            if llm.engine.offload:
                llm.engine.offload.close()
    base = results["none"]
    for r in results.values():
        r["ratio"] = r["throughput_tok_s"] / base["throughput_tok_s"]
        # each round against the same round without a tier: the VM's drift between rounds cancels
        r["round_ratios"] = [a / b for a, b in zip(r["rounds"], base["rounds"], strict=True)]
        r["median_round_ratio"] = statistics.median(r["round_ratios"])
    return results


def _slowed(get: Any, delay_s: float) -> Any:
    """A tier's block read with a fixed delay first: a remote tier (NFS, object store) simulated on the disk."""
    def slow_get(h: bytes, tokens: tuple[int, ...]) -> Any:
        time.sleep(delay_s)
        return get(h, tokens)
    return slow_get


def _decision_run(args: argparse.Namespace, mode: str, disk: dict[str, Any], delay_s: float,
                  warm: list[list[int]], prompts: dict[int, list[list[int]]]) -> tuple[dict[int, float], int]:
    """A restarted worker in this decision mode: TTFT p50 (ms) per bucket, and the blocks it restored."""
    llm = _llm(args, kv_offload_decision=mode, **disk)
    offload = llm.engine.offload
    assert offload is not None
    if delay_s:
        disk_tier = offload.tiers[0]
        disk_tier.get = _slowed(disk_tier.get, delay_s)  # type: ignore[method-assign]
    for p in warm:  # from the tier: the cost model and the tier's rate are measured before timing
        _ttft(llm, p)
    ttft = {n: 1000 * statistics.median(_ttft(llm, p) for p in ps) for n, ps in prompts.items()}
    offload.close()
    return ttft, offload.restored_blocks


def _fill_disk(args: argparse.Namespace, directory: Path, prompts: list[list[int]]) -> tuple[dict[str, Any], float]:
    """A worker writes the prompts' blocks to a disk tier in `directory`: the options that find them again, and
    its measured cost of recomputing a block (seconds)."""
    disk = {"kv_offload_disk": str(directory), "kv_offload_disk_capacity": "16GiB", "kv_offload_write": "through"}
    writer = _llm(args, **disk)
    for p in prompts:
        _ttft(writer, p)
    offload = writer.engine.offload
    assert offload is not None
    offload.flush()
    block_s = offload.decide.recompute_seconds(0) or 0.0
    offload.close()
    return disk, block_s


def _decision(args: argparse.Namespace, vocab: int, workdir: Path) -> dict[str, Any]:
    rng = random.Random(3)
    buckets = [int(n) for n in args.decision_buckets.split(",")]
    prompts = {n: [_tokens(rng, n, vocab) for _ in range(args.decision_prompts)] for n in buckets}
    warm = [_tokens(rng, n, vocab) for n in buckets]  # fit the step-cost model, measure the tier
    disk, block_s = _fill_disk(args, workdir / "decision", warm + [p for n in buckets for p in prompts[n]])
    if args.slow_tier_ms:
        delays = [float(ms) / 1000 for ms in args.slow_tier_ms.split(",")]
    else:
        delays = [round(f * block_s, 4) for f in SLOW_TIER_FACTORS]
    results: dict[str, Any] = {"block_recompute_ms": 1000 * block_s}
    for tier, delay in [("disk", 0.0), *((f"slow-{1000 * d:g}ms", d) for d in delays)]:
        by_mode: dict[str, dict[int, float]] = {}
        restored: dict[str, int] = {}
        for round_ in range(args.decision_rounds):  # modes alternate; each keeps its best round (order noise)
            for mode in DECISION_MODES:
                ttft, restored[mode] = _decision_run(args, mode, disk, delay, warm, prompts)
                by_mode[mode] = {n: min(ms, by_mode.get(mode, {}).get(n, ms)) for n, ms in ttft.items()}
                print(f"decision {tier} {mode} round {round_ + 1}: "
                      + ", ".join(f"{n} tok {ms:.0f} ms" for n, ms in ttft.items()), file=sys.stderr)
        results[tier] = {"ttft_p50_ms": by_mode, "restored_blocks": restored, "auto_vs_best": {
            n: min(by_mode["load"][n], by_mode["recompute"][n]) / by_mode["auto"][n] for n in buckets}}
    return results


def _plot(working_set: dict[str, Any], path: str, pool_fraction: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tiers = list(working_set["by_tier"])
    values = [working_set["by_tier"][t]["ttft_p50_ms"] for t in tiers]
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.bar(tiers, values, color=["#999999"] + ["#3b7dd8"] * (len(tiers) - 1))
    ax.set_ylabel("TTFT p50, turns 2+ (ms)")
    ax.set_title(f"Working set {1 / pool_fraction:.0f}x the KV pool: TTFT by offload tier")
    for i, v in enumerate(values):
        ax.text(i, v, f"{v:.0f}", ha="center", va="bottom")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run_offload_bench(args: argparse.Namespace) -> int:
    scenarios = [s for s in args.scenarios.split(",") if s]
    tiers = [t for t in args.tiers.split(",") if t]
    cfg = engine_config_from_args(args)
    model = load_checkpoint(resolve_model(cfg.model)).config
    per_token = bytes_per_block(model, cfg.block_size, cfg.dtype, cfg.kv_cache_dtype) / cfg.block_size
    result: dict[str, Any] = {"model": cfg.model, "dtype": str(cfg.dtype).removeprefix("torch."), "tiers": tiers}
    with tempfile.TemporaryDirectory(prefix="kvyard-offload-") as tmp:
        workdir = Path(tmp)
        if "working-set" in scenarios:
            result["working_set"] = _working_set(args, tiers, per_token, model.vocab_size, workdir)
            if args.plot_out:
                _plot(result["working_set"], args.plot_out, args.pool_fraction)
        if "restart" in scenarios:
            result["restart"] = _restart(args, model.vocab_size, workdir)
        if "no-reuse" in scenarios:
            result["no_reuse"] = _no_reuse(args, tiers, per_token, model.vocab_size, workdir)
        if "decision" in scenarios:
            result["decision"] = _decision(args, model.vocab_size, workdir)
        if "overlap" in scenarios:
            from kvyard.bench.offload_overlap import run_overlap

            result["overlap"] = run_overlap(args, model.vocab_size, workdir)
    emit_json(result, args.json_out)
    return 0
