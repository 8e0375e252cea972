import json

from kvyard.cli.main import main


def test_bench_quant_tiny(tiny_checkpoint, tmp_path):
    out = tmp_path / "quant.json"
    rc = main(["bench", "quant", "--model", str(tiny_checkpoint("llama")), "--schemes", "int8,int4-g32,kv-int8",
               "--batch-sizes", "1,4", "--input-len", "16", "--decode-steps", "4", "--repeats", "1",
               "--dtype", "float32", "--json-out", str(out), "--out-dir", str(tmp_path / "ckpts")])
    assert rc == 0
    result = json.loads(out.read_text())
    table = result["schemes"]
    assert set(table) == {"float32", "int8", "int4-g32", "kv-int8"}
    assert table["kv-int8"]["kv_bytes_per_token"] < 0.7 * table["float32"]["kv_bytes_per_token"]
    assert 0 < table["kv-int8"]["kl_mean"] < 1e-2
    assert table["int4-g32"]["weight_bytes"] < table["int8"]["weight_bytes"] < table["float32"]["weight_bytes"]
    for name in ("int8", "int4-g32"):
        assert table[name]["kl_mean"] > 0 and table[name]["decode_tok_s_b4"] > 0
        assert table[name]["speedup_b1"] > 0
    # With --dtype float32 the re-measure of each saved checkpoint (and of the KV cache) in float32 is the
    # same measurement as the one made while quantizing.
    for name in ("int8", "int4-g32", "kv-int8"):
        assert abs(table[name]["kl_mean_fp32"] - table[name]["kl_mean"]) <= 1e-4 * table[name]["kl_mean"] + 1e-9
