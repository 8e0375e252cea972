"""What the router saw, for its operator's console (kvyard/router/dashboard.py): the latest routing decisions
and the latency of the streams it relayed, each in a bounded window.

TTFT here is the router's: from the moment it took the request to the first event relayed (routing,
tokenizing and the worker's queue included). ITL is the gap between consecutive events of one stream.
"""

import time
from collections import Counter, deque
from dataclasses import dataclass, field

WINDOW = 2000  # latency samples kept per kind
DECISIONS = 500  # routing decisions kept


def percentile(values: list[float], q: float) -> float | None:
    """The q-quantile (0..1) by linear interpolation between the two nearest ranks; None when empty."""
    if not values:
        return None
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@dataclass
class Observed:
    ttft: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))
    itl: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))
    decisions: deque[tuple[float, str, str]] = field(default_factory=lambda: deque(maxlen=DECISIONS))
    ttft_at: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))  # time.monotonic() of each

    def record_ttft(self, seconds: float) -> None:
        self.ttft.append(seconds)
        self.ttft_at.append(time.monotonic())

    def ttft_quantile_since(self, since: float, q: float = 0.5) -> float | None:
        """The q-quantile of the TTFTs seen since `since` (time.monotonic()), in seconds; None if none."""
        return percentile([v for v, t in zip(self.ttft, self.ttft_at, strict=True) if t >= since], q)

    def decided(self, worker: str, reason: str) -> None:
        self.decisions.append((time.time(), worker, reason))

    def latency(self) -> dict[str, dict[str, float | int | None]]:
        """p50 / p90 / p99 in milliseconds over the window, and how many samples it holds."""
        out: dict[str, dict[str, float | int | None]] = {}
        for name, window in (("ttft", self.ttft), ("itl", self.itl)):
            values = list(window)
            out[name] = {"count": len(values)}
            for label, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
                v = percentile(values, q)
                out[name][label] = None if v is None else round(1000 * v, 2)
        return out

    def decisions_by_worker(self, since: float) -> dict[str, dict[str, int]]:
        """Decisions since `since` (unix time), per worker and reason."""
        per: dict[str, Counter[str]] = {}
        for t, worker, reason in self.decisions:
            if t >= since:
                per.setdefault(worker, Counter())[reason] += 1
        return {w: dict(c) for w, c in per.items()}
