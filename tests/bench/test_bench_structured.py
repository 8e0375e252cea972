import json

from kvyard.cli.main import main


def test_bench_structured_reports_overhead_and_compile_times(smollm2_path, tmp_path):
    out = tmp_path / "s.json"
    rc = main(["bench", "structured", "--model", str(smollm2_path), "--batch-sizes", "1,2", "--steps", "4",
               "--repeats", "1", "--json-out", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    for b in ("b1", "b2"):
        assert r["median_itl_ms"][f"{b}.constrained.itl_ms"] > 0 and r["median_itl_ms"][f"{b}.plain.itl_ms"] > 0
        assert b in r["itl_overhead"]
    assert r["compile"]["cached_compile_ms"] < r["compile"]["first_compile_ms"]
