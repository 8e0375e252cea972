import json

from kvyard.cli.main import main
from tests.quant.same_kl import same_kl


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
        assert same_kl(table[name]["kl_mean"], table[name]["kl_mean_fp32"])


def test_bench_quant_measures_fidelity_in_its_own_dtype(tiny_checkpoint, tmp_path):
    """--fidelity-dtype float32 quantizes and measures in float32 while the timed models run in bf16: the KL
    then equals the float32 re-measure of the saved checkpoint."""
    out = tmp_path / "quant.json"
    rc = main(["bench", "quant", "--model", str(tiny_checkpoint("llama")), "--schemes", "int8",
               "--batch-sizes", "1", "--input-len", "8", "--decode-steps", "2", "--repeats", "1",
               "--dtype", "bfloat16", "--fidelity-dtype", "float32", "--json-out", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    assert (result["dtype"], result["fidelity_dtype"]) == ("bfloat16", "float32")
    assert set(result["schemes"]) == {"bfloat16", "int8"}
    row = result["schemes"]["int8"]
    assert row["kl_mean"] > 0 and same_kl(row["kl_mean"], row["kl_mean_fp32"])
    assert result["machine"]["cpu_threads"] >= 1 and "platform" in result["machine"]


def test_bench_quant_gguf_keeps_the_files_blocks(tmp_path):
    """`--schemes gguf`: a Q4_1 GGUF served with its own blocks measures as its dequantized self in float32 (the
    weights are the file's), in a quarter-ish of the bytes."""
    from tests.loader.tiny_gguf import Q, write_tiny_gguf
    from tests.tiny import make_tiny_checkpoint

    gguf = write_tiny_gguf(make_tiny_checkpoint(tmp_path / "hf", "llama"), tmp_path / "q4.gguf", Q.Q4_1)
    out = tmp_path / "quant.json"
    rc = main(["bench", "quant", "--model", str(gguf), "--schemes", "gguf", "--batch-sizes", "1",
               "--input-len", "8", "--decode-steps", "2", "--repeats", "1", "--json-out", str(out)])
    assert rc == 0
    table = json.loads(out.read_text())["schemes"]
    assert set(table) == {"bfloat16", "gguf"}
    row = table["gguf"]
    assert 0 <= row["kl_mean_fp32"] < 1e-6 and row["top1_agreement_fp32"] == 1.0
    assert row["weight_bytes"] < 0.75 * table["bfloat16"]["weight_bytes"] and row["decode_tok_s_b1"] > 0
    # in bf16 both ways of serving the file are measured against it: each rounds its activations
    assert row["kl_mean"] > 0 and table["bfloat16"]["kl_mean"] > 0


def test_bench_quant_dynamic_quant_twins(tmp_path):
    """--dynamic-quant adds each low-bit scheme served with int8 activations: its own KL (above the same weights'
    in bf16, since it rounds x further) and speed, beside its plain twin."""
    from kvyard.kernels import cpu as cpu_kernels
    from tests.loader.tiny_gguf import Q, write_tiny_gguf
    from tests.tiny import make_tiny_checkpoint

    if not cpu_kernels.int8_act_available():
        import pytest
        pytest.skip("kvyard's AVX2 kernels are not built here")
    gguf = write_tiny_gguf(make_tiny_checkpoint(tmp_path / "hf", "llama"), tmp_path / "q4.gguf", Q.Q4_1)
    out = tmp_path / "quant.json"
    rc = main(["bench", "quant", "--model", str(gguf), "--schemes", "gguf,int8", "--dynamic-quant",
               "--batch-sizes", "1,4", "--input-len", "8", "--decode-steps", "2", "--repeats", "1",
               "--json-out", str(out), "--out-dir", str(tmp_path / "ckpts")])
    assert rc == 0
    table = json.loads(out.read_text())["schemes"]
    assert set(table) == {"bfloat16", "gguf", "gguf+dynamic-quant", "int8", "int8+dynamic-quant"}
    for name in ("gguf", "int8"):
        twin = table[f"{name}+dynamic-quant"]
        assert twin["kl_mean"] > 0 and twin["decode_tok_s_b4"] > 0 and twin["dynamic_quant_speedup_b4"] > 0
        assert twin["weight_bytes"] == table[name]["weight_bytes"]
    assert table["gguf+dynamic-quant"]["kl_mean"] > table["gguf"]["kl_mean"]
