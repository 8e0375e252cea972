"""`kvyard bench offload` on a tiny model: each scenario runs and reports what the tiers did."""

import json

import pytest

from kvyard.cli.main import main


@pytest.mark.slow  # 31 s: every offload scenario end to end; tests/offload covers each tier
def test_every_scenario_reports_its_comparison(tiny_checkpoint, tmp_path):
    out = tmp_path / "offload.json"
    plot = tmp_path / "ttft.png"
    rc = main(["bench", "offload", "--model", str(tiny_checkpoint("llama")), "--dtype", "float32",
               "--block-size", "4", "--conversations", "3", "--turns", "2", "--history-len", "40",
               "--user-len", "4", "--output-len", "4", "--pool-fraction", "0.5", "--restart-prompt-len", "60", "--no-reuse-requests", "6", "--no-reuse-prompt-len", "64",
               "--decision-buckets", "16,64", "--decision-prompts", "2", "--slow-tier-ms", "50",
               "--overlap-streams", "2", "--overlap-loads", "2", "--overlap-prompt-len", "40", "--overlap-gap-ms", "30",
               "--tiers", "host,disk", "--json-out", str(out), "--plot-out", str(plot)])
    assert rc == 0
    r = json.loads(out.read_text())
    ws = r["working_set"]["by_tier"]
    assert set(ws) == {"none", "host", "disk"} and ws["none"]["tiers"] == {}
    # the working set is twice the pool: without a tier the second turn finds little; with one, more
    for tier in ("host", "disk"):
        assert ws[tier]["tiers"][tier]["restored"] > 0 and ws[tier]["hit_tokens"] > ws["none"]["hit_tokens"]
    assert r["restart"]["restored_blocks"] == (60 - 1) // 4
    assert set(r["no_reuse"]) == {"none", "host", "disk", "disk+admit2"} and plot.stat().st_size > 1000
    cpu = r["no_reuse"]["disk"]["cpu"][0]  # where the time went: no Redis server here
    assert 0 <= cpu["writer_cpu_s"] < cpu["process_cpu_s"] and cpu["redis_server_cpu_s"] == 0 and cpu["wall_s"] > 0
    # A tier 50 ms a block is slower than recomputing anything on the tiny model: once measured (the first
    # warm-up restore), auto stops reading it; forced load reads every block, forced recompute none.
    slow = r["decision"]["slow-50ms"]
    assert set(slow["ttft_p50_ms"]) == {"auto", "load", "recompute"} and set(slow["ttft_p50_ms"]["auto"]) == {"16", "64"}
    assert slow["restored_blocks"]["recompute"] == 0
    assert 0 < slow["restored_blocks"]["auto"] < slow["restored_blocks"]["load"]
    for name in ("disk", next(k for k in r["overlap"] if k.startswith("disk+"))):
        runs = r["overlap"][name]
        assert all(runs[mode]["restored_blocks"] > 0 and runs[mode]["itl_p99_ms"] > 0 for mode in ("blocking", "overlap"))
