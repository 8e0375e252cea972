"""Goodput: the highest load at which a deployment still meets its SLOs (#38, `kvyard tune`'s inner search).

A probe offers the workload as Poisson arrivals at a rate (or a trace replayed that many times faster) and
counts the requests that met every SLO. The probe passes when at least `attain` of them did (DistServe's
definition: 90% by default). The search doubles the rate from `start_rate` until a probe fails (or halves it
until one passes), then bisects the bracket geometrically until it is narrower than `resolution`; the probes
are bounded by `max_probes`. Every probe draws its own prompts, so no probe finds another's in the prefix
cache. The deployment's goodput is the best passing probe's offered requests/s times the share that met the
SLOs (what DistServe reports), not the requests over the run's duration, which a short probe's tail distorts.
"""

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from kvyard.bench.serve_load import LoadSpec
from kvyard.bench.serve_metrics import SLOs
from kvyard.bench.serve_run import ServeBenchConfig, run_benchmark
from kvyard.bench.serve_workloads import WorkloadSpec


@dataclass
class Probe:
    rate: float  # requests/s offered (a trace: times its recorded speed)
    attained: float  # share of the requests that met every SLO
    goodput_rps: float  # requests/s offered that met them: the offered rate times `attained`
    output_tok_s: float  # every completed request's output tokens a second: the deployment's throughput
    tok_s_per_user: float  # 1000 / the median TPOT: how fast one stream reads
    failed: int  # requests that errored
    passed: bool
    errors: dict[str, int] = field(default_factory=dict)  # the commonest errors, by message
    ttft_p90_ms: float | None = None  # which SLO gave way first
    tpot_p90_ms: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class GoodputSearch:
    url: str
    workload: WorkloadSpec
    slos: SLOs
    attain: float = 0.9
    start_rate: float = 1.0
    min_rate: float = 0.05
    max_rate: float = 512.0
    resolution: float = 0.15  # stop once the highest pass and lowest fail are within 15%
    max_probes: int = 8
    trace: str | None = None
    tokenizer: str | None = None
    timeout: float = 120.0  # seconds a single request may take

    def __post_init__(self) -> None:
        if not self.slos.given():
            raise ValueError("a goodput search needs at least one SLO: goodput is the load that meets them")

    def probe(self, rate: float, seed: int) -> Probe:
        load = (LoadSpec(mode="trace", time_scale=1 / rate) if self.trace else
                LoadSpec(mode="poisson", rate=rate, seed=seed))
        cfg = ServeBenchConfig(url=self.url, workload=replace(self.workload, seed=seed), loads=[load],
                               tokenizer=self.tokenizer, slos=self.slos, progress=False, per_request=False,
                               trace=self.trace, timeout=self.timeout)
        s = run_benchmark(cfg)["runs"][0]["summary"]
        attained = s["goodput"]["fraction"]
        # A trace's own arrivals set the offered rate; it is the requests over the time they took to arrive,
        # which the run's duration (ending at the last answer) overstates little when the probe passes.
        offered = s["num_requests"] / s["duration_s"] if self.trace else rate
        tpot = (s["tpot_ms"] or {}).get("p50")
        return Probe(rate, attained, offered * attained, s["output_throughput"], 1000 / tpot if tpot else 0.0,
                     s["failed"], attained >= self.attain and s["completed"] > 0, s["errors"],
                     (s["ttft_ms"] or {}).get("p90"), (s["tpot_ms"] or {}).get("p90"))

    def run(self, seed: int = 0) -> list[Probe]:
        """Probe until the bracket is narrow enough; every probe, in the order run."""
        probes: list[Probe] = []
        best: float | None = None  # highest rate that passed
        worst: float | None = None  # lowest rate that failed
        rate = self.start_rate
        while len(probes) < self.max_probes:
            p = self.probe(rate, seed * 1000 + len(probes))
            probes.append(p)
            if p.passed:
                best = rate if best is None else max(best, rate)
            else:
                worst = rate if worst is None else min(worst, rate)
            if worst is None:
                rate *= 2
            elif best is None:
                rate /= 2
            elif worst / best <= 1 + self.resolution:
                break
            else:
                rate = math.sqrt(best * worst)
            if not self.min_rate <= rate <= self.max_rate:
                break
        return probes


def goodput_of(probes: list[Probe]) -> Probe | None:
    """The passing probe at the highest rate (None: none passed, the SLOs are out of reach at any load)."""
    passed = [p for p in probes if p.passed]
    return max(passed, key=lambda p: p.rate) if passed else None
