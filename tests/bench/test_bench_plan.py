"""`kvyard bench plan` on a tiny model: every figure predicted and measured, appended to the record, and a
prediction past the tolerance fails the run loudly."""

import json

import pytest

from kvyard.cli.main import main


# 30-130 s on a 2-core AVX2 EPYC (make test took 55 min there, 2026-12-07): run with -m slow
@pytest.mark.slow
def test_the_plan_bench_records_and_fails_on_drift(tiny_checkpoint, tmp_path, capsys):
    record = tmp_path / "record.jsonl"
    # the layer cost fitted on another model, so every figure of this one is out of sample
    argv = ["bench", "plan", "--models", str(tiny_checkpoint("llama")), "--record", str(record), "--batch", "4",
            "--steps", "4", "--prefill-len", "32", "--input-len", "16",
            "--calibrate-on", str(tiny_checkpoint("llama", tie_word_embeddings=True))]
    assert main([*argv, "--tolerance", "0"]) == 1  # the rates never come out exact
    assert "DRIFT" in capsys.readouterr().out
    rows = [json.loads(line) for line in record.read_text().splitlines()]
    assert {r["figure"] for r in rows} == {"weight_bytes", "decode_tok_s_batch_1", "decode_tok_s_batch_4",
                                          "prefill_tok_s"}
    assert all(r["predicted"] > 0 and r["measured"] > 0 and r["tolerance"] == 0 for r in rows)
    assert not any(r["fitted_on"] for r in rows) and all(r["layer_cost"]["fixed_s"] >= 0 for r in rows)
    assert (tmp_path / "errors.png").read_bytes().startswith(b"\x89PNG")
    assert main([*argv, "--tolerance", "1000"]) == 0
    assert len(record.read_text().splitlines()) == 2 * len(rows)  # appended, not replaced
