"""`kvyard bench lora` on a tiny model: random PEFT adapters written, base and mixed rounds timed, the ratio
reported from the medians."""

import json

from kvyard.cli.main import main
from kvyard.lora.adapter import load_adapter


def test_the_lora_bench_reports_rounds_and_the_ratio(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "result.json"
    assert main(["bench", "lora", "--model", str(tiny_checkpoint("llama")), "--dtype", "float32", "--adapters", "3",
                 "--rank", "4", "--targets", "q_proj,down_proj", "--num-requests", "6", "--input-len", "16",
                 "--output-len", "4", "--rounds", "2", "--adapter-dir", str(tmp_path / "adapters"),
                 "--json-out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert len(result["rounds"]) == 2 and result["adapters"] == 3
    assert all(r["base_tok_s"] > 0 and r["lora_tok_s"] > 0 for r in result["rounds"])
    assert abs(result["ratio"] - result["lora_tok_s"] / result["base_tok_s"]) < 1e-9
    written = sorted((tmp_path / "adapters").glob("*/adapter-*"))
    assert len(written) == 3
    from kvyard.loader.checkpoint import load_checkpoint

    adapter = load_adapter("x", written[0], load_checkpoint(tiny_checkpoint("llama")).config)
    assert adapter.max_rank == 4 and {m for _, m in adapter.modules} == {"q_proj", "down_proj"}
