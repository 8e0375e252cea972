import json
import subprocess
import sys

from kvyard.cli.main import main

KVYARD = [sys.executable, "-m", "kvyard.cli.main"]


def test_generate_streams_text(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    proc = subprocess.run(
        KVYARD + ["generate", "--model", str(path), "--dtype", "float32", "--max-tokens", "8",
                  "--temperature", "0", "--raw", "The quick"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "[8 tokens, finish_reason=length]" in proc.stderr
    assert proc.stdout.strip()


def test_bad_checkpoint_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "model.gguf").write_bytes(b"not a gguf file at all")
    code = main(["generate", "--model", str(tmp_path / "model.gguf"), "hello"])
    assert code == 2
    assert "model.gguf" in capsys.readouterr().err


def test_bench_offline_reports_ratios(tiny_checkpoint, tmp_path):
    out = tmp_path / "bench.json"
    code = main(["bench", "offline", "--model", str(tiny_checkpoint("llama")), "--dtype", "float32",
                 "--num-requests", "4", "--input-len", "16", "--output-len", "8", "--range-ratio", "0.5",
                 "--batch1-requests", "1", "--repeats", "2", "--json-out", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    ratios = result["ratios"]
    assert set(ratios) == {"batch_throughput_vs_hf_padded", "batch1_throughput_vs_hf"}
    assert len(ratios["batch_throughput_vs_hf_padded"]["per_round"]) == 2
    assert result["median"]["kvyard.batch.tok_s"] > 0 and result["median"]["hf.batch.tok_s"] > 0
    assert result["kvyard_prefix_hit_tokens"] == 0  # every round's prompts are new to the cache
