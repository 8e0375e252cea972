"""`kvyard bench ray` with the tiny model: `kvyard up --ray` as a process on a simulated 2-node cluster, the
workload through its router, then a node lost and the time until the replacement serves; and the plot."""

import json

import pytest

from kvyard.bench.ray_route import plot
from kvyard.cli.main import main
from tests.router.test_up_cluster import free_port_run


# 30-130 s on a 2-core AVX2 EPYC (make test took 55 min there, 2026-12-07): run with -m slow
@pytest.mark.slow
def test_bench_ray_measures_the_ray_deployment_and_its_recovery(tiny_checkpoint, tmp_path):
    pytest.importorskip("ray")
    model = str(tiny_checkpoint("llama"))
    rc = main(["bench", "ray", "--model", model, "--tokenizer", model, "--replicas", "1", "--phases", "ray,recovery", "--rounds", "1",
               "--serve-args", "--dtype float32 --kv-cache-memory 2MiB", "--router-port", str(free_port_run(1)),
               "--workload", "multi-turn", "--turns", "2", "--num-requests", "6", "--input-len", "32",
               "--output-len", "4", "--concurrency", "2", "--no-progress", "--out-dir", str(tmp_path)])
    assert rc == 0
    report = json.loads((tmp_path / "report.json").read_text())
    [cell] = report["ray"]
    assert cell["completed"] == 6 and cell["failed"] == 0 and 0 <= cell["ray_daemons_cpu_share"] < 1
    rec = report["recovery"]
    # Ray's death signal takes the replica out fast; its replacement loads a model first, on the spare node.
    assert 0 < rec["marked_dead_s"] <= rec["first_served_by_replacement_s"] < 180


def test_the_autoscale_plot_is_written(tmp_path):
    samples = [(0.0, 1, 1), (15.0, 16, 1), (20.0, 16, 2), (75.0, 0, 2), (100.0, 0, 1)]
    plot(samples, tmp_path / "autoscale.png")
    assert (tmp_path / "autoscale.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
