import json

from kvyard.cli.main import main
from kvyard.disagg.bandwidth import loopback_tcp_gbps, run_transfer_bench
from kvyard.disagg.layout import KVLayout


def test_loopback_measures_something():
    assert loopback_tcp_gbps(1 << 20) > 0


def test_transfer_bench_reports_every_mode():
    r = run_transfer_bench(KVLayout(2, 2, 8, 4, "bfloat16", False), num_tokens=30, repeats=1)
    assert r["blocks"] == 8 and r["bytes"] == 8 * 4 * 2 * 2 * 2 * 8 * 2
    assert r["loopback_tcp_gbps"] > 0 and r["checksum_gbps"] > 0
    assert set(r["modes"]) == {"blocks", "layers", "shm", "shm-in-place"}
    assert set(r["stages_ms"]) == {"gather", "checksum_one_side", "copy_to_receive_buffer", "scatter_into_cache"}
    for m in r["modes"].values():
        assert m["gbps"] > 0 and m["ms_per_transfer"] > 0 and m["ratio_to_loopback"] > 0


def test_cli_takes_the_layout_from_a_model(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "kv.json"
    rc = main(["bench", "kv-transfer", "--model", str(tiny_checkpoint("llama")), "--tokens", "16", "--repeats", "1",
               "--kv-cache-dtype", "int8", "--modes", "layers", "--json-out", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r == json.loads(capsys.readouterr().out)
    assert r["layout"]["dtype"] == "int8" and r["layout"]["quantized"] and list(r["modes"]) == ["layers"]
    assert main(["bench", "kv-transfer", "--modes", "tcp"]) == 2
