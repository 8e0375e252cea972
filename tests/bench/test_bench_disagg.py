"""`kvyard bench disagg`'s arithmetic: token gaps placed in time, and the colocated/disaggregated ratios."""

from kvyard.bench.disagg import _token_gaps, compare, summarize_rounds
from kvyard.bench.serve_client import RequestResult


def test_token_gaps_are_placed_at_their_arrival_times():
    r = RequestResult(ok=True, start=1.0, expected_output_tokens=3, ttft=0.5, itls=[0.1, 0.2])
    gaps = _token_gaps(r)
    assert [round(t, 6) for t, _ in gaps] == [1.6, 1.8] and [g for _, g in gaps] == [0.1, 0.2]


def test_compare_reports_ratios_against_colocated():
    def dep(itl: float, ttft: float, tput: float, gbps: float | None) -> dict:
        run = {"itl_ms": {"p50": itl, "p99": 10 * itl}, "long_ttft_ms": {"p50": ttft},
               "loopback_tcp_gbps_under_load": 1.25}
        return {"mixed": run, "short_only": {"output_throughput": tput, "ttft_ms": {"p50": 5.0}},
                "kv_transfer_gbps": gbps}

    r = compare(dep(100.0, 1000.0, 50.0, None), dep(50.0, 1500.0, 45.0, 1.0), loopback_gbps=2.0)
    assert r["itl_p50_colocated_over_disagg"] == 2.0 and r["itl_p99_colocated_over_disagg"] == 2.0
    assert r["long_ttft_p50_disagg_over_colocated"] == 1.5
    assert r["short_only_throughput_disagg_over_colocated"] == 0.9
    assert r["transfer_over_loopback"] == 0.5 and r["transfer_over_loopback_under_load"] == 0.8


def test_short_only_rounds_are_summarized_by_medians_and_compared_per_round():
    def rnd(tput: float, ttft: float) -> dict:
        return {"failed": 0, "output_throughput": tput, "ttft_ms": {"p50": ttft}}

    co = summarize_rounds([rnd(50.0, 100.0), rnd(40.0, 300.0), rnd(60.0, 200.0)])
    dis = summarize_rounds([rnd(55.0, 90.0), rnd(40.0, 310.0), rnd(30.0, 250.0)])
    assert co["output_throughput"] == 50.0 and co["ttft_ms"]["p50"] == 200.0 and len(co["rounds"]) == 3
    run = {"itl_ms": {"p50": 1.0, "p99": 1.0}, "long_ttft_ms": {"p50": 1.0}, "loopback_tcp_gbps_under_load": 1.0}
    r = compare({"mixed": run, "short_only": co, "kv_transfer_gbps": None},
                {"mixed": run, "short_only": dis, "kv_transfer_gbps": 1.0}, loopback_gbps=2.0)
    assert r["short_only_throughput_per_round"] == [1.1, 1.0, 0.5] and r["short_only_throughput_paired_median"] == 1.0
    assert r["short_only_throughput_disagg_over_colocated"] == 40.0 / 50.0
