"""`kvyard bench spec`: what speculative decoding buys at batch 1, per drafter and workload, and what
adaptive speculation costs under load.

Each row is one target engine with a drafter swapped in and out (`engine.spec`), so with and without
speculation run on the same weights in the same process. Every prompt runs both ways back to back, the
order alternating, for `--repeats` rounds: noise from other processes hits both sides. Decode tokens/s
counts from the first output token (prefill excluded) to the last; greedy outputs are compared (identical in
float32 and with --batch-invariant; in plain bfloat16 the verify pass and a plain decode round differently, so
near-ties can flip).
The load row submits `--concurrency` requests at once, adaptive speculation on against off.
"""

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from kvyard.bench.output import emit_json, machine_info
from kvyard.llm import LLM
from kvyard.sampling_params import SamplingParams
from kvyard.spec.decoding import SpeculativeDecoding
from kvyard.spec.ngram import LookupFirst
from kvyard.spec.setup import make_speculation
from kvyard.spec.speculator.prompts import read_prompts

DATA = Path(__file__).parent / "spec_data"
WORKLOADS = {
    "chat": DATA / "chat_eval.jsonl",  # held out from chat_train.jsonl: the speculator's own workload
    "code": DATA / "code_completion.jsonl",
    "rewrite": DATA / "rewrite.jsonl",  # edits whose output copies the prompt
}
ROWS = ("pair", "ngram", "speculator", "speculator-model", "unrelated", "load")


@dataclass
class Row:
    name: str
    drafter: str  # as shown in the table
    target: str
    workload: str
    spec: dict  # EngineConfig fields that choose the drafter
    target_speedup: float | None
    max_tokens: int
    num_prompts: int
    model_only: bool = False  # a speculator without its prompt lookup: what the trained model alone gives


def add_spec_bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("spec", help="speculative decoding: batch-1 decode speedup per drafter, and under load")
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma list of {', '.join(ROWS)}")
    p.add_argument("--target", default="smollm2-135m", help="target of the ngram, speculator and load rows")
    p.add_argument("--speculator", default=None, help="trained speculator directory for --target")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per request (batch-1 rows)")
    p.add_argument("--num-prompts", type=int, default=6, help="prompts per batch-1 row")
    p.add_argument("--repeats", type=int, default=2, help="rounds; each prompt runs with and without in each")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--pair-target", default="qwen2.5-coder-1.5b")
    p.add_argument("--pair-draft", default="qwen2.5-coder-0.5b")
    p.add_argument("--pair-max-tokens", type=int, default=48, help="the pair row is slow on a CPU: keep it small")
    p.add_argument("--pair-prompts", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=32, help="requests submitted at once in the load row")
    p.add_argument("--load-max-tokens", type=int, default=160,
                   help="the load row's longest request; the others' max_tokens spread evenly below it")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kv-cache-memory", default="1GiB")
    p.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
                   help="the targets on the batch-invariant path (default: the engine's, on where it costs nothing): "
                        "bf16 outputs then match with and without speculation")
    p.add_argument("--json-out", default=None)
    p.add_argument("--md-out", default=None)
    p.set_defaults(func=run_spec_bench)


def plan_rows(args: argparse.Namespace) -> tuple[list[Row], list[str]]:
    wanted = [r.strip() for r in args.rows.split(",") if r.strip()]
    n, m = args.num_prompts, args.max_tokens
    spec = {"speculator": args.speculator}
    rows = {
        "pair": Row("pair", f"{args.pair_draft} → {args.pair_target}", args.pair_target, "code",
                    {"speculative_model": args.pair_draft}, 1.8, args.pair_max_tokens, args.pair_prompts),
        "ngram": Row("ngram", "n-gram", args.target, "rewrite", {"speculative_method": "ngram"}, 1.5, m, n),
        "speculator": Row("speculator", "trained speculator", args.target, "chat", spec, 1.3, m, n),
        "speculator-model": Row("speculator-model", "trained speculator, model only (no prompt lookup)",
                                args.target, "chat", spec, None, m, n, model_only=True),
        "unrelated": Row("unrelated", "trained speculator", args.target, "code", spec, None, m, n),
    }
    notes = []
    out = []
    for name in wanted:
        if name not in ROWS:
            raise SystemExit(f"unknown row {name!r}; choose from {', '.join(ROWS)}")
        if name in ("speculator", "speculator-model", "unrelated") and not args.speculator:
            notes.append(f"row {name} skipped: needs --speculator")
        elif name != "load":
            out.append(rows[name])
    return out, notes


class Engines:
    """One engine per target; drafters built once per row and swapped in with `use`."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.llms: dict[str, LLM] = {}

    def llm(self, target: str) -> LLM:
        if target not in self.llms:
            self.llms[target] = LLM(target, dtype=self.args.dtype, kv_cache_memory=self.args.kv_cache_memory,
                                    batch_invariant=self.args.batch_invariant)
        return self.llms[target]

    def drafter(self, llm: LLM, spec: dict, model_only: bool = False) -> SpeculativeDecoding:
        eng = llm.engine
        cfg = replace(eng.cfg, num_speculative_tokens=self.args.num_speculative_tokens, **spec)
        made = make_speculation(cfg, llm.tokenizer, eng.model_config.vocab_size, eng.blocks.num_blocks,
                                eng.max_model_len)
        assert made is not None
        if model_only and isinstance(made.proposer, LookupFirst):
            made.proposer = made.proposer.fallback
        return made


def decode_run(llm: LLM, prompt: list[int], max_tokens: int) -> tuple[list[int], int, float]:
    """(output ids, decode tokens, decode seconds): everything after the step that emitted the first token."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    first_t, first_n, last_t, ids = 0.0, 0, 0.0, []
    for out in llm.stream(prompt, params):
        ids = out.outputs[0].token_ids
        last_t = time.perf_counter()
        if not first_n:
            first_t, first_n = last_t, len(ids)
    return list(ids), len(ids) - first_n, last_t - first_t


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def batch1_row(engines: Engines, row: Row, repeats: int) -> dict:
    llm = engines.llm(row.target)
    spec = engines.drafter(llm, row.spec, row.model_only)
    prompts = read_prompts(WORKLOADS[row.workload], llm.tokenizer, row.num_prompts)
    llm.engine.spec = spec
    decode_run(llm, prompts[0], 8)  # warm-up, both ways
    llm.engine.spec = None
    decode_run(llm, prompts[0], 8)
    spec.stats = type(spec.stats)()
    rounds, same, total = [], 0, 0
    for r in range(repeats):
        tally = {"on": [0, 0.0], "off": [0, 0.0]}
        for i, prompt in enumerate(prompts):
            order = ("on", "off") if (r + i) % 2 == 0 else ("off", "on")
            outs = {}
            for side in order:
                llm.engine.spec = spec if side == "on" else None
                outs[side], n, secs = decode_run(llm, prompt, row.max_tokens)
                tally[side][0] += n
                tally[side][1] += secs
            same += common_prefix(outs["on"], outs["off"])
            total += len(outs["off"])
        on, off = (tally[s][0] / max(tally[s][1], 1e-9) for s in ("on", "off"))
        rounds.append({"on_tok_s": on, "off_tok_s": off, "speedup": on / off, "decode_tokens": tally["on"][0]})
        print(f"{row.name} round {r + 1}: on {on:.1f} tok/s, off {off:.1f} tok/s, {on / off:.2f}x", file=sys.stderr)
    llm.engine.spec = None
    on_med = statistics.median(x["on_tok_s"] for x in rounds)
    off_med = statistics.median(x["off_tok_s"] for x in rounds)
    s = spec.stats
    return {
        "row": row.name, "drafter": row.drafter, "target": row.target, "workload": row.workload,
        "prompts": len(prompts), "max_tokens": row.max_tokens,
        "off_tok_s": off_med, "on_tok_s": on_med, "speedup": on_med / off_med,
        "per_round": [round(x["speedup"], 3) for x in rounds],
        "acceptance_rate": s.acceptance_rate, "mean_accepted_length": s.mean_accepted_length,
        "drafter_ms_per_step": 1000 * s.drafter_seconds_per_step,
        # Share of the plain greedy output reproduced before the first difference (1.0: identical). Below 1
        # only in bf16, where the verify pass (a GEMM over k + 1 rows) and a decode (GEMV) round differently.
        "output_match": same / max(1, total),
        "target_speedup": row.target_speedup,
    }


def load_row(engines: Engines, args: argparse.Namespace) -> dict:
    llm = engines.llm(args.target)
    spec_fields = {"speculator": args.speculator} if args.speculator else {"speculative_method": "ngram"}
    spec = engines.drafter(llm, spec_fields)
    prompts = read_prompts(WORKLOADS["chat"], llm.tokenizer)
    prompts = [prompts[i % len(prompts)] for i in range(args.concurrency)]
    # Lengths spread evenly up to --load-max-tokens: requests finish one after another, so the batch
    # passes through every size and speculation turns on once few enough are left.
    n = args.concurrency
    params = [SamplingParams(max_tokens=max(1, args.load_max_tokens * (i + 1) // n), temperature=0.0)
              for i in range(n)]
    for side in (spec, None):  # warm-up, both ways: one-time costs land in no round
        llm.engine.spec = side
        llm.generate(prompts, params)
    spec.stats = type(spec.stats)()
    rounds = []
    for r in range(args.repeats):
        row = {}
        for side in (("on", "off") if r % 2 == 0 else ("off", "on")):
            llm.engine.spec = spec if side == "on" else None
            start = time.perf_counter()
            outs = llm.generate(prompts, params)
            row[f"{side}_tok_s"] = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)
        row["ratio"] = row["on_tok_s"] / row["off_tok_s"]
        print(f"load round {r + 1}: on {row['on_tok_s']:.1f} tok/s, off {row['off_tok_s']:.1f} tok/s", file=sys.stderr)
        rounds.append(row)
    llm.engine.spec = None
    on_med = statistics.median(x["on_tok_s"] for x in rounds)
    off_med = statistics.median(x["off_tok_s"] for x in rounds)
    return {"drafter": "trained speculator" if args.speculator else "n-gram", "target": args.target,
            "concurrency": args.concurrency, "max_tokens": args.load_max_tokens,
            "speculative_max_batch": spec.max_batch, "off_tok_s": off_med, "on_tok_s": on_med,
            "ratio": on_med / off_med, "per_round": [round(x["ratio"], 3) for x in rounds], "target_ratio": 0.95,
            "acceptance_rate": spec.stats.acceptance_rate, "drafter_steps": spec.stats.drafter_steps}


def markdown(result: dict) -> str:
    lines = ["| drafter | target | workload | tok/s off | tok/s on | speedup | per round | acceptance | "
             "mean accepted length | drafter ms/step | output match | target |", "|" + "---|" * 12]
    for r in result["rows"]:
        want = f"≥ {r['target_speedup']}×" if r["target_speedup"] else "reported"
        lines.append(f"| {r['drafter']} | {r['target']} | {r['workload']} | {r['off_tok_s']:.1f} | {r['on_tok_s']:.1f}"
                     f" | **{r['speedup']:.2f}×** | {', '.join(map(str, r['per_round']))} | {r['acceptance_rate']:.2f}"
                     f" | {r['mean_accepted_length']:.2f} | {r['drafter_ms_per_step']:.1f} | {r['output_match']:.0%}"
                     f" | {want} |")
    if (ld := result.get("load")) is not None:
        lines += ["", "| under load | concurrency | tok/s off | tok/s on | on / off | per round | target |",
                  "|---|---|---|---|---|---|---|",
                  f"| adaptive {ld['drafter']} (off above {ld['speculative_max_batch']} decoding) | "
                  f"{ld['concurrency']} | {ld['off_tok_s']:.1f} | {ld['on_tok_s']:.1f} | **{ld['ratio']:.2f}×** | "
                  f"{', '.join(map(str, ld['per_round']))} | ≥ 0.95× |"]
    return "\n".join(lines)


def run_spec_bench(args: argparse.Namespace) -> int:
    rows, notes = plan_rows(args)
    engines = Engines(args)
    result: dict = {"machine": machine_info(),
                    "dtype": args.dtype, "repeats": args.repeats, "num_speculative_tokens": args.num_speculative_tokens,
                    "rows": [], "notes": notes}
    for row in rows:
        result["rows"].append(batch1_row(engines, row, args.repeats))
    if "load" in args.rows.split(","):
        result["load"] = load_row(engines, args)
    emit_json(result, args.json_out)
    table = markdown(result)
    print(table)
    if args.md_out:
        Path(args.md_out).write_text(table + "\n")
    return 0
