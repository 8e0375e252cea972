"""`kvyard bench lora` on a tiny model: random PEFT adapters written, base and mixed rounds timed, the ratio
reported from the medians."""

import json

from kvyard.bench.lora_loop import INSTRUCTION, is_exact
from kvyard.cli.main import main
from kvyard.loader.checkpoint import load_checkpoint
from kvyard.lora.adapter import load_adapter
from kvyard.net import free_port


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
    adapter = load_adapter("x", written[0], load_checkpoint(tiny_checkpoint("llama")).config)
    assert adapter.max_rank == 4 and {m for _, m in adapter.modules} == {"q_proj", "down_proj"}


def test_the_loop_bench_captures_trains_hot_loads_and_scores(tiny_checkpoint, tmp_path):
    """The whole loop on a tiny random model (its answers are never right: the figures are the real model's)."""
    out = tmp_path / "loop.json"
    assert main(["bench", "lora-loop", "--model", str(tiny_checkpoint("llama")), "--dtype", "float32",
                 "--port", str(free_port()), "--train-requests", "12", "--eval-requests", "4", "--max-tokens", "6",
                 "--keep", "all", "--epochs", "2", "--shadow-pairs", "3", "--bar", "json_valid_candidate>=0", "--startup-timeout", "120", "--work-dir", str(tmp_path / "w"),
                 "--json-out", str(out)]) == 0
    result = json.loads(out.read_text())
    captured = (tmp_path / "w" / "capture" / "all.jsonl").read_text().splitlines()
    assert len(captured) == 12 and all(json.loads(line)["prompt"].count(INSTRUCTION.strip()) for line in captured)
    assert result["train_examples"] == {"train": 11, "held_out": 1}
    # The bar always holds here: the promotion's decisions are tests/lora/test_promote.py's; this is the pipeline
    assert result["promotion"]["promoted"] and result["promotion"]["summary"]["requests"] >= 3
    assert set(result["eval"]) == {"base_bare", "base_instructed", "adapter_bare"}
    assert result["eval"]["base_instructed"]["prompt_tokens"] > result["eval"]["base_bare"]["prompt_tokens"]
    assert result["eval"]["adapter_bare"]["prompt_tokens"] == result["eval"]["base_bare"]["prompt_tokens"]
    assert load_adapter("task", tmp_path / "w" / "adapter", load_checkpoint(tiny_checkpoint("llama")).config)


def test_the_task_metric_wants_the_exact_object():
    assert is_exact(' {"city": "Rome", "name": "Tom"}\n', {"name": "Tom", "city": "Rome"})
    assert not is_exact('{"name": "Tom"}', {"name": "Tom", "city": "Rome"})
    assert not is_exact("Tom lives in Rome", {"name": "Tom", "city": "Rome"})
