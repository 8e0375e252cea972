"""`kvyard shadow report PAIRS.jsonl`: the router's shadow record read back as a verdict a person can act on (#37).

The record (`shadow: {record: FILE}` in the router's settings) has one line per mirrored request: its score, and
unless redacted the request and both texts. The report holds the scores against budgets, counts the pairs that
could not be compared, and lists the worst requests with their texts side by side. It writes report.md,
report.json and report.png, prints the Markdown, and exits 1 when the candidate fails the budgets (a gate for
a rollout script).
"""

import argparse
import json
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from kvyard.errors import ConfigError
from kvyard.shadow.compare import Budgets, PairScore, Verdict, verdict

SHOWN_CHARS = 600  # of each text in the Markdown's worst requests


def read_record(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise ConfigError(f"{path}: no shadow record there (the router writes it with shadow: {{record: FILE}})")
    lines = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            lines.append(json.loads(line))
        except ValueError as e:
            raise ConfigError(f"{path}:{n}: not a JSON line ({e})") from e
    return lines


def pair_score(line: dict[str, Any]) -> PairScore:
    known = {f.name for f in fields(PairScore)}
    score = {k: v for k, v in line["score"].items() if k in known}
    score["json_valid"] = tuple(score["json_valid"])
    return PairScore(**score)


def build(lines: list[dict[str, Any]], budgets: Budgets, worst: int) -> tuple[Verdict, dict[str, int]]:
    scores = [pair_score(line) for line in lines if line.get("score")]
    counts = {"pairs": len(lines), "scored": len(scores)}
    for line in lines:
        for side in line.get("errors") or {}:
            counts[f"{side}_failed"] = counts.get(f"{side}_failed", 0) + 1
    return verdict(scores, budgets, worst), counts


def markdown(v: Verdict, counts: dict[str, int], budgets: Budgets, lines: list[dict[str, Any]]) -> str:
    out = [f"# Shadow report: {'PASS' if v.passed else 'FAIL'}", ""]
    out.append(", ".join(f"{k.replace('_', ' ')}: {n}" for k, n in counts.items()))
    out += ["", "| figure | candidate | budget |", "|---|---|---|"]
    for name in ("kl_mean", "kl_p99", "top1_agreement", "exact_match", "ttft_delta_s"):
        if name in v.summary:
            budget = getattr(budgets, name, None)
            out.append(f"| {name} | {v.summary[name]:.4g} | {'' if budget is None else f'{budget:g}'} |")
    if v.failures:
        out += ["", "Over budget:", *[f"- {f}" for f in v.failures]]
    by_id = {line["id"]: line for line in lines}
    out += ["", f"## The {len(v.worst)} worst requests", ""]
    for s in v.worst:
        line = by_id.get(s.request_id, {})
        out.append(f"### {s.request_id}: KL mean {s.kl_mean:.3g} (max {s.kl_max:.3g}), top-1 "
                   f"{s.top1_agreement:.0%}, exact match {'yes' if s.exact_match else 'no'}")
        for label, text in (("request", _request(line.get("request"))), ("primary", _text(line.get("primary"))),
                            ("candidate", _text(line.get("candidate")))):
            if text is not None:
                shown = text if isinstance(text, str) else json.dumps(text)
                out += ["", f"{label}:", "```", shown[:SHOWN_CHARS], "```"]
        out.append("")
    return "\n".join(out) + "\n"


def _request(request: dict[str, Any] | None) -> Any:
    """A prompt sent as token ids is shown as its text."""
    if request and "prompt_text" in request:
        return {"prompt": request["prompt_text"], **{k: v for k, v in request.items() if k not in ("prompt",
                                                                                            "prompt_text")}}
    return request


def _text(answer: dict[str, Any] | None) -> str | None:
    if answer is None:
        return None
    calls = answer.get("tool_calls")
    return answer["text"] + (f"\ntool calls: {json.dumps(calls)}" if calls else "")


def plot(v: Verdict, scores: list[PairScore], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (kl_ax, ttft_ax) = plt.subplots(1, 2, figsize=(11, 4))
    kls = sorted(max(s.kl_mean, 1e-9) for s in scores if s.scored_tokens)
    if kls:
        kl_ax.plot(kls, [(i + 1) / len(kls) for i in range(len(kls))], drawstyle="steps-post")
    kl_ax.set(xscale="log", xlabel="mean KL(primary || candidate) per request, nats", ylabel="share of requests",
              title="teacher-forced KL")
    deltas = sorted(s.ttft_delta_s * 1000 for s in scores if s.ttft_delta_s is not None)
    if deltas:
        ttft_ax.plot(deltas, [(i + 1) / len(deltas) for i in range(len(deltas))], drawstyle="steps-post")
    ttft_ax.axvline(0, color="grey", linewidth=0.8)
    ttft_ax.set(xlabel="candidate TTFT - primary TTFT, ms", ylabel="share of requests", title="time to first token")
    fig.suptitle(f"shadow report: {'PASS' if v.passed else 'FAIL'}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_report(args: argparse.Namespace) -> int:
    budgets = Budgets(kl_mean=args.kl_mean, kl_p99=args.kl_p99, exact_match=args.exact_match,
                      ttft_delta_s=args.ttft_delta_s)
    lines = read_record(Path(args.record))
    v, counts = build(lines, budgets, args.worst)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(v, counts, budgets, lines)
    (out / "report.md").write_text(text)
    by_id = {line["id"]: line for line in lines}
    (out / "report.json").write_text(json.dumps({
        "passed": v.passed, "failures": v.failures, "summary": v.summary, "counts": counts,
        "budgets": asdict(budgets), "worst": [{**by_id.get(s.request_id, {}), "score": asdict(s)} for s in v.worst],
    }, indent=2))
    plot(v, [pair_score(line) for line in lines if line.get("score")], out / "report.png")
    print(text)
    print(f"written: {out / 'report.md'}, {out / 'report.json'}, {out / 'report.png'}")
    return 0 if v.passed else 1


def add_shadow_parser(sub: argparse._SubParsersAction) -> None:
    shadow = sub.add_parser("shadow", help="shadow deployments").add_subparsers(dest="shadow", required=True)
    p = shadow.add_parser("report", help="the verdict on a candidate from the router's shadow record "
                                         "(exits 1 when it is over budget)")
    p.add_argument("record", help="the JSON-lines file the router writes (shadow: {record: FILE})")
    p.add_argument("--out", default="shadow-report", help="the folder for report.md, report.json and report.png")
    p.add_argument("--worst", type=int, default=10, help="how many of the worst requests to list")
    defaults = Budgets()
    p.add_argument("--kl-mean", type=float, default=defaults.kl_mean, help="budget: mean KL per token, nats")
    p.add_argument("--kl-p99", type=float, default=defaults.kl_p99, help="budget: the 99th percentile request's KL")
    p.add_argument("--exact-match", type=float, default=defaults.exact_match,
                   help="budget: the least share of temperature-0 requests with the primary's exact text")
    p.add_argument("--ttft-delta-s", type=float, default=defaults.ttft_delta_s,
                   help="budget: the candidate's mean extra time to first token, seconds")
    p.set_defaults(func=run_report)
