"""From per-request results to the numbers a serving benchmark reports.

Latencies are in milliseconds, throughputs per second of the whole run (first send to last byte).
ITL percentiles pool the gaps of every request, so long outputs weigh more (as vLLM reports them);
TPOT is one number per request. Goodput counts the requests that met every SLO given.
"""

import statistics
from collections import Counter
from dataclasses import dataclass
from typing import Any

from kvyard.bench.serve_client import RequestResult


@dataclass
class SLOs:
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def given(self) -> dict[str, float]:
        return {k: v for k, v in vars(self).items() if v is not None}

    def met(self, r: RequestResult) -> bool:
        if not r.ok:
            return False
        checks = [
            (self.ttft_ms, r.ttft),
            (self.tpot_ms, r.tpot),  # None for one-token outputs: nothing to miss
            (self.e2e_ms, r.e2e),
        ]
        return all(limit is None or value is None or 1000 * value <= limit for limit, value in checks)


def percentile(sorted_values: list[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), on an already sorted list."""
    if not sorted_values:
        raise ValueError("no values")
    pos = (len(sorted_values) - 1) * p / 100
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def distribution(seconds: list[float], percentiles: list[float]) -> dict[str, float] | None:
    """mean, percentiles, min and max of latencies given in seconds, reported in ms."""
    if not seconds:
        return None
    ms = sorted(1000 * s for s in seconds)
    out = {"mean": statistics.fmean(ms)}
    out |= {f"p{p:g}": percentile(ms, p) for p in percentiles}
    out |= {"min": ms[0], "max": ms[-1]}
    return out


def summarize(results: list[RequestResult], duration: float, percentiles: list[float], slos: SLOs
              ) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    prompt_known = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    summary: dict[str, Any] = {
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": dict(Counter(r.error for r in results if not r.ok).most_common(5)),
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_output_tokens": out_tokens,
        "expected_output_tokens": sum(r.expected_output_tokens for r in ok),
        # Did every completed request produce exactly max_tokens? (A server that stops at EOS does not.)
        "output_tokens_match": bool(ok) and all(r.output_tokens == r.expected_output_tokens for r in ok),
        "mean_output_tokens": out_tokens / len(ok) if ok else 0.0,
        # How output lengths were known: the server's usage, finish_reason "length", or counted chunks.
        "token_count_source": dict(Counter(r.token_source for r in ok)),
        "finish_reasons": dict(Counter(str(r.finish_reason) for r in ok)),
        "total_input_tokens": sum(prompt_known) if len(prompt_known) == len(ok) else None,
        "ttft_ms": distribution([r.ttft for r in ok if r.ttft is not None], percentiles),
        "tpot_ms": distribution([t for r in ok if (t := r.tpot) is not None], percentiles),
        "itl_ms": distribution([g for r in ok for g in r.itls], percentiles),
        "e2e_ms": distribution([r.e2e for r in ok if r.e2e is not None], percentiles),
    }
    if summary["total_input_tokens"] is not None:
        summary["total_token_throughput"] = (summary["total_input_tokens"] + out_tokens) / duration
    if slos.given():
        good = sum(slos.met(r) for r in results)
        summary["goodput"] = {"slos_ms": slos.given(), "requests_meeting": good,
                              "fraction": good / len(results) if results else 0.0, "rate": good / duration}
    return summary


def request_records(results: list[RequestResult]) -> list[dict[str, Any]]:
    """A compact per-request table for the JSON file (the ITL gaps are in the summary; each request keeps its
    longest, to tell which requests a tail came from)."""
    def ms(s: float | None) -> float | None:
        return None if s is None else round(1000 * s, 3)

    return [{"start_s": round(r.start, 4), "ok": r.ok, "ttft_ms": ms(r.ttft), "tpot_ms": ms(r.tpot),
             "e2e_ms": ms(r.e2e), "itl_max_ms": ms(max(r.itls, default=None)),
             "output_tokens": r.output_tokens, "expected_output_tokens": r.expected_output_tokens,
             "prompt_tokens": r.prompt_tokens, "finish_reason": r.finish_reason, "token_source": r.token_source, "chunks": r.chunks,
             "error": r.error} for r in results]
