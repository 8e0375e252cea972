"""`kvyard retrofit --attention swa`: a window wider than the text changes nothing; a narrow one serves in
kvyard as transformers runs it (qwen2 with per-layer `layer_types`), and the paged cache gives the blocks behind
the window back."""

import json

import pytest
import torch
import transformers

from kvyard import LLM, SamplingParams
from kvyard.cli.main import main
from kvyard.engine.window_blocks import HybridBlocks, WindowBlocks
from kvyard.errors import ConfigError
from kvyard.models.config import ModelConfig
from kvyard.retrofit.attention import parse_layers, slide_layers
from tests.conftest import assert_greedy_matches
from tests.tiny import make_tiny_checkpoint

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _retrofit(base, out, *flags: str) -> dict:
    assert main(["retrofit", "--model", str(base), "--out", str(out), "--attention", "swa", "--eval-prompts", "2",
                 "--dtype", "float32", "--distill-prompts", "0", *flags]) == 0
    return json.loads((out / "retrofit_report.json").read_text())


def test_a_window_wider_than_the_text_changes_nothing(tmp_path):
    base = make_tiny_checkpoint(tmp_path / "base", "llama")  # no biases: the conversion adds zero ones
    report = _retrofit(base, tmp_path / "swa", "--window", "4096")
    assert report["converted"]["kl_mean"] < 1e-6 and report["converted"]["top1_agreement"] == 1.0
    assert report["kv_saving"] == 1.0  # the window holds the whole 2,048-token context
    original = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    converted = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "swa", dtype=torch.float32).eval()
    assert converted.config.model_type == "qwen2" and set(converted.config.layer_types) == {"sliding_attention"}
    ids = torch.tensor([list(range(1, 60))])
    with torch.no_grad():
        assert torch.allclose(original(ids).logits, converted(ids).logits, atol=1e-5)


@pytest.mark.parametrize(("layers", "pool"), [("all", WindowBlocks), ("1", HybridBlocks)])
def test_a_narrow_window_serves_as_transformers_runs_it_and_gives_blocks_back(tmp_path, layers, pool):
    base = make_tiny_checkpoint(tmp_path / "base", "llama")
    out = tmp_path / "swa"
    report = _retrofit(base, out, "--window", "8", "--layers", layers, "--kv-context", "64")
    assert report["converted"]["kl_mean"] > 1e-3  # the window is narrower than the text: a real change
    assert report["kv_saving"] == pytest.approx(8.0 if layers == "all" else 2 * 64 / (64 + 8))
    converted = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    llm = LLM(str(out), dtype="float32", block_size=4)
    assert isinstance(llm.engine.blocks, pool)
    prompt = list(range(3, 43))  # 40 tokens: five windows
    assert_greedy_matches(converted, prompt, llm.generate([prompt], GREEDY)[0].outputs[0].token_ids, tie=1e-4)
    # Mid-generation, the sliding layers hold their window's blocks (and one more a window straddles), no more
    llm.engine.add_request(prompt, GREEDY)
    llm.engine.step()
    req = llm.engine.scheduler.running[0]
    sliding = llm.engine.blocks if pool is WindowBlocks else llm.engine.blocks.window_pool
    assert sliding.live_blocks(req) <= 8 // 4 + 2 < len(sliding.table(req))


def test_layers_and_sources_are_checked():
    assert parse_layers("0-2,5", 8) == [0, 1, 2, 5] and parse_layers("all", 3) == [0, 1, 2]
    for spec in ("8", "x", "3-", ""):
        with pytest.raises(ConfigError, match="--layers"):
            parse_layers(spec, 8)
    with pytest.raises(ConfigError, match="not 'gemma3_text'"):
        slide_layers({"model_type": "gemma3_text"}, {}, 8, [0])


def test_qwen2_slides_the_layers_hf_slides():
    cfg = {"model_type": "qwen2", "vocab_size": 32, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 4, "num_attention_heads": 4, "use_sliding_window": True, "sliding_window": 16}
    assert ModelConfig.from_hf({**cfg, "max_window_layers": 2}).layer_windows == (None, None, 16, 16)
    kinds = ["sliding_attention", "full_attention"] * 2
    assert ModelConfig.from_hf({**cfg, "layer_types": kinds}).layer_windows == (16, None, 16, None)
    assert not any(ModelConfig.from_hf({**cfg, "use_sliding_window": False}).layer_windows)
