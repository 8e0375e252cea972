"""The goodput search: probes double up to the first failure, bisect the bracket and stop within bounds."""

import pytest

from kvyard.bench.serve_metrics import SLOs
from kvyard.bench.serve_workloads import WorkloadSpec
from kvyard.plan.goodput import GoodputSearch, Probe, goodput_of


class FakeDeployment(GoodputSearch):
    """Meets the SLOs up to `capacity` requests/s; records the rates and seeds it was probed at."""

    capacity = 10.0

    def probe(self, rate, seed):
        self.seen = [*getattr(self, "seen", []), (rate, seed)]
        passed = rate <= self.capacity
        return Probe(rate, 1.0 if passed else 0.5, rate if passed else rate / 2, 50 * rate, 20.0, 0, passed)


def search(**kw):
    return FakeDeployment(url="http://127.0.0.1:1", workload=WorkloadSpec(), slos=SLOs(tpot_ms=100), **kw)


def test_doubles_then_bisects_to_within_the_resolution():
    s = search(start_rate=1.0, resolution=0.15, max_probes=12)
    probes = s.run()
    best = goodput_of(probes)
    assert [p.rate for p in probes[:5]] == [1, 2, 4, 8, 16]
    assert 10 / 1.15 <= best.rate <= 10
    assert best.goodput_rps == best.rate
    assert len({seed for _, seed in s.seen}) == len(probes)  # every probe its own prompts


def test_halves_when_the_first_probe_fails_and_stops_at_the_bounds():
    s = search(start_rate=64.0, max_probes=20)
    probes = s.run()
    assert [p.rate for p in probes[:4]] == [64, 32, 16, 8]
    assert goodput_of(probes).rate <= 10
    s = search(start_rate=1.0, max_probes=3)
    assert len(s.run()) == 3
    FakeDeployment.capacity = 0.0  # nothing passes: no goodput, and the search ends at min_rate
    try:
        probes = search(start_rate=1.0, min_rate=0.1, max_probes=20).run()
        assert goodput_of(probes) is None and probes[-1].rate >= 0.1
    finally:
        FakeDeployment.capacity = 10.0


def test_a_search_without_slos_is_refused():
    with pytest.raises(ValueError, match="SLO"):
        GoodputSearch(url="http://127.0.0.1:1", workload=WorkloadSpec(), slos=SLOs())
