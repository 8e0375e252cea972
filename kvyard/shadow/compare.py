"""Scoring a candidate deployment against the primary on the same requests (#37's comparator).

For each mirrored request the primary's answer and the candidate's are compared:
- exact match of the text (meaningful at temperature 0);
- teacher-forced KL(primary ‖ candidate) on the primary's own output tokens: both deployments score the
  primary's prompt + output (`prompt_logprobs` on /v1/completions, the top-k of every position), and at each
  output position the two distributions are compared over the primary's listed tokens plus one bucket for the
  rest. That coarsened KL is a lower bound of the full one (merging outcomes never raises KL) and exactly 0
  when the two agree;
- top-1 agreement: the same most likely token at a position;
- JSON validity of both texts, and for tool calls the same function names and arguments;
- the TTFT and inter-token time deltas.
A verdict holds the scores against budgets and lists the worst requests (by KL, then mismatches) to read.
"""

import json
import math
from dataclasses import dataclass, field
from typing import Any

Dist = dict[int, float]  # token id -> logprob: a position's top-k (and the scored token)
REST_FLOOR = 1e-12  # the least mass a distribution's "rest" bucket may have (log of 0 is undefined)


def coarse_kl(p: Dist, q: Dist) -> float:
    """KL(p ‖ q) over p's listed tokens and one bucket for everything else. A token q does not list gets the
    least logprob q lists (it cannot be more likely than that)."""
    if not p:
        return 0.0
    q_missing = min(q.values()) if q else math.log(REST_FLOOR)
    kl, p_mass, q_mass = 0.0, 0.0, 0.0
    for token, lp in p.items():
        lq = q.get(token, q_missing)
        prob = math.exp(lp)
        kl += prob * (lp - lq)
        p_mass += prob
        q_mass += math.exp(lq)
    p_rest, q_rest = max(1.0 - p_mass, 0.0), max(1.0 - q_mass, REST_FLOOR)
    if p_rest > REST_FLOOR:
        kl += p_rest * (math.log(p_rest) - math.log(q_rest))
    return max(kl, 0.0)


def top1(d: Dist) -> int | None:
    return max(d, key=d.__getitem__) if d else None


@dataclass
class Answer:
    """One deployment's answer to a mirrored request, and its scoring of the primary's output."""

    text: str
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    dists: list[Dist] = field(default_factory=list)  # per output position of the primary's tokens
    tool_calls: list[dict[str, Any]] | None = None  # [{"name": ..., "arguments": "..."}]


@dataclass
class PairScore:
    request_id: str
    exact_match: bool
    kl_mean: float
    kl_max: float
    top1_agreement: float
    json_valid: tuple[bool, bool]  # (primary, candidate)
    tools_agree: bool | None  # None: no tool calls on either side
    ttft_delta_s: float | None  # candidate minus primary
    itl_delta_s: float | None  # the same, mean inter-token times
    greedy: bool = True  # sampled at temperature 0: only then must the texts match
    scored_tokens: int = 0  # the output positions teacher-forced on both sides (0: no KL or top-1 measured)


def score_pair(request_id: str, primary: Answer, candidate: Answer, greedy: bool = True) -> PairScore:
    positions = list(zip(primary.dists, candidate.dists, strict=False))
    kls = [coarse_kl(p, q) for p, q in positions]
    agree = [top1(p) == top1(q) for p, q in positions]
    tools = None
    if primary.tool_calls or candidate.tool_calls:
        tools = _calls(primary.tool_calls) == _calls(candidate.tool_calls)
    return PairScore(
        request_id=request_id,
        exact_match=primary.text == candidate.text,
        kl_mean=sum(kls) / len(kls) if kls else 0.0,
        kl_max=max(kls, default=0.0),
        top1_agreement=sum(agree) / len(agree) if agree else 1.0,
        json_valid=(is_json(primary.text), is_json(candidate.text)),
        tools_agree=tools,
        ttft_delta_s=None if primary.ttft_s is None or candidate.ttft_s is None else candidate.ttft_s - primary.ttft_s,
        itl_delta_s=_mean(candidate.itl_s) - _mean(primary.itl_s) if primary.itl_s and candidate.itl_s else None,
        greedy=greedy,
        scored_tokens=len(positions),
    )


def _calls(calls: list[dict[str, Any]] | None) -> list[tuple[str, Any]]:
    """Tool calls as (name, parsed arguments): argument JSON that differs only in spacing or key order agrees."""
    out = []
    for c in calls or []:
        try:
            args = json.loads(c.get("arguments") or "{}")
        except json.JSONDecodeError:
            args = c.get("arguments")
        out.append((c.get("name"), args))
    return out


def is_json(text: str) -> bool:
    try:
        json.loads(text)
    except (json.JSONDecodeError, ValueError):
        return False
    return True


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


@dataclass
class Budgets:
    """What a candidate may differ by before it is flagged."""

    kl_mean: float = 0.01  # nats per token, mean over requests
    kl_p99: float = 0.1  # nats per token, the 99th percentile of the requests' means
    exact_match: float = 0.95  # the share of requests with the primary's exact text (temperature 0)
    ttft_delta_s: float = 0.05  # the mean TTFT delta


@dataclass
class Verdict:
    passed: bool
    failures: list[str]  # each budget exceeded, with the figure
    summary: dict[str, float]
    worst: list[PairScore]  # the requests to read first


def verdict(scores: list[PairScore], budgets: Budgets, worst: int = 10) -> Verdict:
    """Only the pairs that were teacher-forced count for KL and top-1, only the greedy ones for exact match; a
    figure nothing measured is left out of the summary and of the checks."""
    if not scores:
        return Verdict(False, ["no request was compared"], {}, [])
    forced = [s for s in scores if s.scored_tokens]
    greedy = [s for s in scores if s.greedy]
    ttfts = [s.ttft_delta_s for s in scores if s.ttft_delta_s is not None]
    summary = {"requests": float(len(scores)), "scored_requests": float(len(forced)),
               "greedy_requests": float(len(greedy))}
    if forced:
        kls = sorted(s.kl_mean for s in forced)
        summary["kl_mean"] = sum(kls) / len(kls)
        summary["kl_p99"] = kls[min(len(kls) - 1, math.ceil(0.99 * len(kls)) - 1)]
        summary["top1_agreement"] = sum(s.top1_agreement for s in forced) / len(forced)
    if greedy:
        summary["exact_match"] = sum(s.exact_match for s in greedy) / len(greedy)
    if ttfts:
        summary["ttft_delta_s"] = sum(ttfts) / len(ttfts)
    # The share of answers that are JSON on each side: a task bar for a candidate meant to change behaviour
    summary["json_valid_primary"] = sum(s.json_valid[0] for s in scores) / len(scores)
    summary["json_valid_candidate"] = sum(s.json_valid[1] for s in scores) / len(scores)
    checks = [(name, higher) for name, higher in (("kl_mean", False), ("kl_p99", False), ("exact_match", True),
                                                  ("ttft_delta_s", False)) if name in summary]
    failures = [f"{name} {summary[name]:.4g} against a budget of {getattr(budgets, name):g}"
                for name, higher in checks
                if (summary[name] < getattr(budgets, name) if higher else summary[name] > getattr(budgets, name))]
    ranked = sorted(scores, key=lambda s: (-s.kl_mean, s.exact_match or not s.greedy, s.top1_agreement))
    return Verdict(not failures, failures, summary, ranked[:worst])
