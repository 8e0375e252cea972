"""`kvyard bench route` with the tiny model: one cell end to end (worker and router processes), and the ratios."""

import json

from kvyard.bench.route import ratios
from kvyard.cli.main import main
from tests.router.test_up_cluster import free_port_run


def test_bench_route_runs_a_cell_and_reports_hits_against_the_oracle(tiny_checkpoint, tmp_path, capsys):
    model = str(tiny_checkpoint("llama"))
    port = free_port_run(2)
    rc = main(
        [
            "bench",
            "route",
            "--model",
            model,
            "--replicas",
            "1",
            "--policies",
            "kv",
            "--workload",
            "multi-turn",
            "--turns",
            "3",
            "--num-requests",
            "6",
            "--input-len",
            "40",
            "--output-len",
            "4",
            "--concurrency",
            "2",
            "--num-threads",
            "1",
            "--serve-args",
            "--dtype float32 --kv-cache-memory 2MiB",
            "--route-args",
            "--log-level warning",
            "--router-port",
            str(port),
            "--out-dir",
            str(tmp_path),
            "--no-progress",
            "--tokenizer",
            model,
        ]
    )
    assert rc == 0
    report = json.loads((tmp_path / "report.json").read_text())
    [cell] = report["cells"]
    assert cell["replicas"] == 1 and cell["policy"] == "kv" and cell["completed"] == 6 and cell["failed"] == 0
    # One worker: every request goes there, and it is always the best match, so the router equals the oracle.
    assert cell["largest_worker_share"] == 1.0
    assert cell["oracle_hit_blocks"] > 0 and cell["hit_rate_vs_oracle"] == 1.0
    assert 0 < cell["observed_hit_rate"] <= 1  # later turns reuse the conversation so far
    assert cell["ttft_p50_ms"] <= cell["ttft_p99_ms"]
    assert "hit/oracle" in capsys.readouterr().err


def test_ratios_compare_each_policy_to_the_first():
    cells = [
        {"replicas": 2, "policy": "kv", "ttft_p50_ms": 10.0, "output_throughput": 100.0},
        {"replicas": 2, "policy": "round-robin", "ttft_p50_ms": 25.0, "output_throughput": 95.0},
    ]
    assert ratios(cells, "kv") == {
        "2 replicas: round-robin/kv TTFT p50": 2.5,
        "2 replicas: kv/round-robin output throughput": 100.0 / 95.0,
    }
