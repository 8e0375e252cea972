"""`kvyard bench spec` runs every row end to end on tiny models (a few tokens each)."""

import json

from kvyard.cli.main import main


def test_bench_spec_on_tiny_models(target_path, small_draft_path, speculator_dir, tmp_path, capsys):
    json_out, md_out = tmp_path / "spec.json", tmp_path / "spec.md"
    rc = main([
        "bench", "spec", "--target", str(target_path), "--speculator", str(speculator_dir),
        "--pair-target", str(target_path), "--pair-draft", str(small_draft_path), "--max-tokens", "10",
        "--num-prompts", "2", "--pair-max-tokens", "8", "--pair-prompts", "1", "--repeats", "1",
        "--concurrency", "4", "--load-max-tokens", "6", "--dtype", "float32", "--kv-cache-memory", "8MiB",
        "--json-out", str(json_out), "--md-out", str(md_out),
    ])
    assert rc == 0
    result = json.loads(json_out.read_text())
    assert [r["row"] for r in result["rows"]] == ["pair", "ngram", "speculator", "speculator-model", "unrelated"]
    for r in result["rows"]:
        assert r["output_match"] == 1.0 and r["on_tok_s"] > 0 and r["off_tok_s"] > 0, r
        assert 0.0 <= r["acceptance_rate"] <= 1.0
    assert result["load"]["concurrency"] == 4 and result["load"]["on_tok_s"] > 0
    table = md_out.read_text()
    assert "| n-gram |" in table and "trained speculator" in table and "≥ 0.95×" in table
    assert table in capsys.readouterr().out
