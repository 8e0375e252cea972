"""`kvyard tune` on a tiny model: it beats a deliberately bad default, skips an injected crash, resumes, and
writes a deployment file that `kvyard serve --config` runs; the fidelity gate holds back changed numerics."""

import json

import httpx
import pytest

from kvyard.bench.compare_serve import ManagedServer
from kvyard.bench.serve_metrics import SLOs
from kvyard.bench.serve_workloads import WorkloadSpec
from kvyard.cli.main import main
from kvyard.plan.goodput import GoodputSearch
from kvyard.plan.tune import TuneOptions, Tuner
from kvyard.plan.tune_space import Candidate, candidates, load_base
from kvyard.router.launcher import kvyard_command
from kvyard.server.config import load_deploy_config

PORT = 8791


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    return tiny_checkpoint("llama")


# 30-130 s on a 2-core AVX2 EPYC (make test took 55 min there, 2026-12-07): run with -m slow
@pytest.mark.slow
def test_tune_beats_a_bad_default_and_skips_a_crash(tiny, tmp_path):
    base = tmp_path / "base.yaml"
    base.write_text(f"engine:\n  model: {tiny}\n  max_num_seqs: 1\n  dtype: float32\n")
    out = tmp_path / "tune"
    argv = ["tune", "--base", str(base), "--out", str(out), "--port", str(PORT),
            "--knob", "engine.max_num_seqs=16", "--knob", "engine.kv_cache_memory=1KiB,1GiB",
            "--repeats", "1", "--max-probes", "6", "--start-rate", "8", "--num-requests", "24",
            "--input-len", "16", "--output-len", "64", "--slo-ttft-ms", "200", "--slo-tpot-ms", "60",
            "--ready-timeout", "120", "--request-timeout", "30"]
    assert main(argv) == 0
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    by_label = {r["label"]: r for r in rows}
    assert list(by_label) == ["default", "max_num_seqs=16, kv_cache_memory=1KiB",
                              "max_num_seqs=16"]
    crashed = by_label["max_num_seqs=16, kv_cache_memory=1KiB"]
    assert crashed["status"] == "infeasible" and "holds no block" in crashed["reason"]
    default, tuned = by_label["default"], by_label["max_num_seqs=16"]
    assert default["status"] == tuned["status"] == "ok"
    assert tuned["goodput_rps"] > 1.3 * default["goodput_rps"], (default, tuned)
    assert (out / "pareto.png").stat().st_size > 0 and "Best: **max_num_seqs=16" in (out / "tune.md").read_text()

    # Resumed: every candidate is in the record, so nothing is started again and the answer is the same.
    logs = sorted(p.name for p in (out / "logs").iterdir())
    assert main(argv) == 0
    assert sorted(p.name for p in (out / "logs").iterdir()) == logs
    assert len((out / "results.jsonl").read_text().splitlines()) == 3

    # The deployment file is one `kvyard serve --config` runs.
    deploy = out / "deploy.yaml"
    assert load_deploy_config(deploy).engine["max_num_seqs"] == 16
    server = ManagedServer(" ".join([*kvyard_command("serve", "--config", str(deploy)), "--port", str(PORT)]),
                           PORT, tmp_path / "serve.log")
    try:
        server.wait_ready(120)
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 4, "ignore_eos": True},
                       timeout=30, trust_env=False)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    finally:
        server.stop()


def _tuner(tiny, tmp_path, space, kl_budget):
    search = GoodputSearch(url="", workload=WorkloadSpec(), slos=SLOs(tpot_ms=100))
    cands = candidates(load_base(None, str(tiny)), space)
    return Tuner(TuneOptions(out=tmp_path, search=search, kl_budget=kl_budget), cands), cands


def test_the_fidelity_gate_measures_the_served_numerics(tiny, tmp_path):
    tuner, cands = _tuner(tiny, tmp_path, {("engine", "quantization"): ["int4-g32"]}, kl_budget=1e-6)
    same = tuner.gate.measure(cands[0])
    assert same["kl_mean"] == 0.0 and same["top1_agreement"] == 1.0  # the base's own numerics: exact
    row = tuner.measure(cands[1])  # over budget: refused before any server starts
    assert row["status"] == "over_kl" and row["fidelity"]["kl_mean"] > 1e-6
    assert not (tmp_path / "logs").exists()


def test_a_candidate_larger_than_one_that_ran_out_of_memory_is_skipped(tiny, tmp_path):
    tuner, cands = _tuner(tiny, tmp_path, {("engine", "max_num_seqs"): [96, 128]}, kl_budget=1.0)
    tuner.rows[cands[1].key] = {"status": "infeasible", "oom": True}
    row = tuner.measure(cands[2])
    assert row["status"] == "skipped" and "max_num_seqs=96" in row["reason"]
    assert isinstance(cands[2], Candidate) and not (tmp_path / "logs").exists()


# 30-130 s on a 2-core AVX2 EPYC (make test took 55 min there, 2026-12-07): run with -m slow
@pytest.mark.slow
def test_a_replica_count_is_a_knob_run_with_kvyard_up(tiny, tmp_path):
    """A candidate with a cluster section runs as `kvyard up` (workers and the router) and is measured the same way."""
    base = tmp_path / "base.yaml"
    base.write_text(f"engine:\n  model: {tiny}\n  dtype: float32\n")
    out = tmp_path / "tune"
    assert main(["tune", "--base", str(base), "--out", str(out), "--port", str(PORT), "--knob", "cluster.replicas=2",
                 "--repeats", "1", "--max-probes", "2", "--start-rate", "4", "--num-requests", "8", "--input-len", "8",
                 "--output-len", "8", "--slo-ttft-ms", "2000", "--ready-timeout", "120", "--request-timeout", "30"]) == 0
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [(r["label"], r["replicas"], r["status"]) for r in rows] == [("default", 1, "ok"), ("replicas=2", 2, "ok")]
    assert all(r["goodput_rps"] > 0 for r in rows)
    log = next((out / "logs").glob(f"{rows[1]['key']}-0.log")).read_text()
    assert "router on port" in log  # it ran as `kvyard up`


def test_a_trace_is_replayed_faster_until_the_slos_give(tiny, tmp_path):
    """With a trace the search's rate is how many times faster than recorded the trace is replayed; goodput is
    the requests that met the SLOs over the time they took."""
    trace = tmp_path / "azure.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
        f"2023-11-16 18:15:{10 + i // 2:02d}.{5 * (i % 2)}000000,12,6\n" for i in range(8)))
    search = GoodputSearch(url="", workload=WorkloadSpec(), slos=SLOs(ttft_ms=2000), trace=str(trace),
                           start_rate=1.0, max_probes=2)
    cands = candidates(load_base(None, str(tiny)), {})
    tuner = Tuner(TuneOptions(out=tmp_path / "tune", search=search, repeats=1, port=PORT, ready_timeout=120), cands)
    row = tuner.run()[0]
    probes = row["runs"][0]["probes"]
    assert row["status"] == "ok" and [p["rate"] for p in probes] == [1.0, 2.0]
    # 8 requests over 3.5 s recorded: about 2.3 req/s at recorded speed, about twice that at twice the speed
    assert 1.0 < probes[0]["goodput_rps"] < 2.4 < probes[1]["goodput_rps"] < 4.8
