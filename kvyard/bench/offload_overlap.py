"""`kvyard bench offload --scenarios overlap`: do a request's loads from a tier stall the streams that decode?

A restarted worker whose disk holds long prompts decodes a few streams; at a fixed interval one of the long
prompts arrives and its blocks are loaded back. With `--kv-offload-load blocking` the engine waits for each read, so
every running stream waits too (the default); with `overlap` the reads run on the reader threads while the
streams go on. Measured on the real disk, and on simulated remote tiers (the disk with a fixed delay per block,
a fraction of the engine's cost of recomputing a block, so the decision still loads): the streams' inter-token
latency (p50, p99, worst), their throughput, and the loaded requests' TTFT, each mode in the same run.
"""

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from kvyard.bench.offload import _fill_disk, _llm, _slowed, _tokens, _ttft
from kvyard.bench.serve_metrics import percentile
from kvyard.sampling_params import SamplingParams

LOAD_MODES = ("blocking", "overlap")
DEADLINE_S = 600  # one run's bound


def add_overlap_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--overlap-streams", type=int, default=8, help="streams decoding while prompts are loaded")
    p.add_argument("--overlap-loads", type=int, default=8, help="prompts loaded from the tier")
    p.add_argument("--overlap-prompt-len", type=int, default=1024)
    p.add_argument("--overlap-gap-ms", type=float, default=500, help="time between two loaded prompts' arrivals")
    p.add_argument("--overlap-delay-fractions", default="0,0.5",
                   help="per-block read delays to add to the disk, as fractions of a block's recompute time")


def _run(args: argparse.Namespace, mode: str, disk: dict[str, Any], delay_s: float, warm: list[int],
         streams: list[list[int]], loads: list[list[int]]) -> dict[str, Any]:
    llm = _llm(args, kv_offload_load=mode, **disk)
    offload, engine = llm.engine.offload, llm.engine
    assert offload is not None
    if delay_s:
        tier = offload.tiers[0]
        tier.get = _slowed(tier.get, delay_s)  # type: ignore[method-assign]
    _ttft(llm, warm)  # from the tier: the cost model and the tier's rate are measured before timing
    gap = args.overlap_gap_ms / 1000
    stream_params = SamplingParams(max_tokens=engine.max_model_len - len(streams[0]) - 1, temperature=0.0,
                                   ignore_eos=True)
    load_params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    stream_ids = [engine.add_request(p, stream_params) for p in streams]
    times: dict[str, list[float]] = {rid: [] for rid in stream_ids}
    loaded: list[Any] = []  # the loaded prompts' requests (the engine forgets them once finished)
    started = time.perf_counter()
    # The window: until the last loaded prompt has its token (the streams, far from done, are then aborted)
    while len(loaded) < len(loads) or not all(r.finished for r in loaded):
        now = time.perf_counter()
        if len(loaded) < len(loads) and now - started >= gap * (len(loaded) + 1):
            loaded.append(engine._tracked[engine.add_request(loads[len(loaded)], load_params)].req)
        if now - started > DEADLINE_S:
            raise RuntimeError(f"the overlap run ({mode}) took over {DEADLINE_S} s")
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.request_id in times and len(out.outputs[0].token_ids) > len(times[out.request_id]):
                times[out.request_id].append(now)
    elapsed = time.perf_counter() - started
    for rid in stream_ids:
        engine.abort_request(rid)
    itl = [b - a for ts in times.values() for a, b in zip(ts[2:], ts[3:], strict=False)]  # past the prefill
    ttft = [r.first_token_time - r.arrival_time for r in loaded]
    restored = offload.restored_blocks
    offload.close()
    return {"itl_p50_ms": 1000 * statistics.median(itl), "itl_p99_ms": 1000 * percentile(sorted(itl), 99),
            "itl_max_ms": 1000 * max(itl), "stream_tok_s": sum(map(len, times.values())) / elapsed,
            "load_ttft_p50_ms": 1000 * statistics.median(ttft), "restored_blocks": restored}


def run_overlap(args: argparse.Namespace, vocab: int, workdir: Path) -> dict[str, Any]:
    rng = random.Random(4)
    loads = [_tokens(rng, args.overlap_prompt_len, vocab) for _ in range(args.overlap_loads)]
    warm = _tokens(rng, args.overlap_prompt_len, vocab)
    streams = [_tokens(rng, 64, vocab) for _ in range(args.overlap_streams)]
    disk, block_s = _fill_disk(args, workdir / "overlap", [warm, *loads])
    results: dict[str, Any] = {"block_recompute_ms": 1000 * block_s}
    for fraction in (float(f) for f in args.overlap_delay_fractions.split(",")):
        # Not rounded: on a fast CPU the tiny model recomputes a block in ~10 us, which 10 us steps made 0.
        delay = fraction * block_s
        name = "disk" if not delay else f"disk+{1000 * delay:.3g}ms"
        by_mode = {}
        for mode in LOAD_MODES:
            by_mode[mode] = r = _run(args, mode, disk, delay, warm, streams, loads)
            print(f"overlap {name} {mode}: stream ITL p50 {r['itl_p50_ms']:.1f} p99 {r['itl_p99_ms']:.1f} max "
                  f"{r['itl_max_ms']:.1f} ms, {r['stream_tok_s']:.1f} tok/s; loaded TTFT p50 "
                  f"{r['load_ttft_p50_ms']:.0f} ms ({r['restored_blocks']} blocks)", file=sys.stderr)
        b, o = by_mode["blocking"], by_mode["overlap"]
        results[name] = {**by_mode, "itl_p99_gain": b["itl_p99_ms"] / o["itl_p99_ms"],
                         "stream_throughput_ratio": o["stream_tok_s"] / b["stream_tok_s"]}
    return results
