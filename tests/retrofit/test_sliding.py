"""`kvyard retrofit --attention swa`: a window wider than the text changes nothing; a narrow one serves in
kvyard as transformers runs it (qwen2 with per-layer `layer_types`), and the paged cache gives the blocks behind
the window back."""

import json

import pytest
import torch
import transformers

from kvyard import LLM, SamplingParams
from kvyard.cli.main import main
from kvyard.engine.block_manager import NULL_BLOCK
from kvyard.engine.window_blocks import HybridBlocks, WindowBlocks
from kvyard.errors import ConfigError
from kvyard.models.config import ModelConfig
from kvyard.retrofit.attention import parse_layers, slide_layers
from kvyard.retrofit.sinks import SinkMasks
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


def _masked_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_the_sink_masks_without_sinks_are_hfs_own_sliding_masks(tmp_path):
    base = make_tiny_checkpoint(tmp_path / "base", "llama")
    _retrofit(base, tmp_path / "swa", "--window", "8")
    converted = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "swa", dtype=torch.float32).eval()
    ids = torch.tensor([list(range(3, 43))])
    with torch.no_grad():
        assert torch.allclose(SinkMasks(converted, 8, 0)(ids).logits, converted(ids).logits, atol=1e-5)
        assert not torch.allclose(SinkMasks(converted, 8, 4)(ids).logits, converted(ids).logits, atol=1e-3)


@pytest.mark.parametrize(("layers", "chunk"), [("all", 256), ("all", 12), ("1", 12)])
def test_sinks_serve_as_the_masks_say_and_keep_their_blocks(tmp_path, layers, chunk):
    base = make_tiny_checkpoint(tmp_path / "base", "llama")
    out = tmp_path / "swa"
    report = _retrofit(base, out, "--window", "8", "--sinks", "4", "--layers", layers, "--kv-context", "64")
    assert report["kv_saving"] == pytest.approx(64 / 12 if layers == "all" else 2 * 64 / (64 + 12))
    hf = SinkMasks(transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval(), 8, 4)
    # chunks of 12 put the sink positions and a window apart in one prefill's context
    llm = LLM(str(out), dtype="float32", block_size=4, max_num_batched_tokens=chunk)
    assert llm.engine.model_config.sliding_window_sinks == 4
    prompt = list(range(3, 43))
    assert llm.generate([prompt], GREEDY)[0].outputs[0].token_ids == _masked_greedy(hf, prompt, 12)
    llm.engine.add_request(prompt, GREEDY)
    for _ in range(5):  # through the prompt's chunks, into decoding
        llm.engine.step()
    req = llm.engine.scheduler.running[0]
    blocks = llm.engine.blocks
    sliding = blocks if layers == "all" else blocks.window_pool
    table = sliding.table(req)
    assert table[0] != NULL_BLOCK and NULL_BLOCK in table  # the sink block kept, blocks behind the window not
    assert sliding.live_blocks(req) <= 1 + 8 // 4 + 2


def test_window_slots_take_the_sinks_then_the_window():
    from kvyard.models.attention import window_slots

    lens = torch.tensor([3, 10, 20])
    blocks = torch.arange(5).repeat(3, 1)  # block i holds positions 4i .. 4i + 3: slot = position
    slots, count = window_slots(blocks, lens, 4, window=6, sinks=2)
    want = [[0, 1, 2], [0, 1, 4, 5, 6, 7, 8, 9], [0, 1, 14, 15, 16, 17, 18, 19]]
    assert count.tolist() == [len(w) for w in want]
    assert [row[:n].tolist() for row, n in zip(slots, count, strict=True)] == want


def test_a_distilled_sink_model_keeps_its_sinks(tmp_path):
    base = make_tiny_checkpoint(tmp_path / "base", "llama")
    out = tmp_path / "swa"
    assert main(["retrofit", "--model", str(base), "--out", str(out), "--attention", "swa", "--window", "8",
                 "--sinks", "4", "--eval-prompts", "2", "--dtype", "float32", "--distill-prompts", "8",
                 "--distill-tokens", "24", "--epochs", "2", "--lr", "3e-3", "--train", "attention",
                 "--no-progress"]) == 0
    report = json.loads((out / "retrofit_report.json").read_text())
    assert report["distillation"]["steps"] > 0 and "distilled" in report
    assert json.loads((out / "config.json").read_text())["sliding_window_sinks"] == 4
    assert LLM(str(out), dtype="float32").engine.model_config.sliding_window_sinks == 4
