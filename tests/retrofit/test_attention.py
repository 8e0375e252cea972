"""`kvyard retrofit --attention mqa`: pooling KV heads is exact where the heads were already equal, the result
serves in kvyard as transformers runs it, and its paged cache holds more tokens in the same memory."""

import json

import pytest
import torch
import transformers

from kvyard import LLM, SamplingParams
from kvyard.cli.main import main
from kvyard.errors import ConfigError
from kvyard.retrofit.attention import pool_kv_heads
from tests.conftest import assert_greedy_matches
from tests.tiny import make_tiny_checkpoint

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _equal_kv_heads(path):
    """The tiny model with its two KV heads made equal in every layer (head 1 := head 0)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.weight[head_dim:] = proj.weight[:head_dim]
                if proj.bias is not None:
                    proj.bias[head_dim:] = proj.bias[:head_dim]
    model.save_pretrained(path)
    return model.eval()


def test_pooling_heads_that_are_already_equal_changes_nothing(tmp_path):
    base = make_tiny_checkpoint(tmp_path / "base", "qwen2")  # biases too
    original = _equal_kv_heads(base)
    assert main(["retrofit", "--model", str(base), "--out", str(tmp_path / "mqa"), "--kv-heads", "1",
                 "--eval-prompts", "2", "--distill-prompts", "0"]) == 0
    report = json.loads((tmp_path / "mqa" / "retrofit_report.json").read_text())
    assert report["kv_heads"] == [2, 1] and report["kv_saving"] == 2.0
    assert report["converted"]["kl_mean"] < 1e-6 and report["converted"]["top1_agreement"] == 1.0
    converted = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "mqa", dtype=torch.float32).eval()
    assert converted.config.num_key_value_heads == 1
    ids = torch.tensor([[1, 40, 41, 42, 43, 44]])
    with torch.no_grad():
        assert torch.allclose(original(ids).logits, converted(ids).logits, atol=1e-5)


def test_the_converted_model_serves_with_twice_the_tokens_in_its_cache(tmp_path):
    base = make_tiny_checkpoint(tmp_path / "base", "llama")  # random heads: pooling changes the model
    assert main(["retrofit", "--model", str(base), "--out", str(tmp_path / "mqa"), "--eval-prompts", "2",
                 "--distill-prompts", "0"]) == 0
    report = json.loads((tmp_path / "mqa" / "retrofit_report.json").read_text())
    assert report["converted"]["kl_mean"] > 1e-3  # a real change, measured
    converted = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "mqa", dtype=torch.float32).eval()
    memory = {"kv_cache_memory": "1MiB", "dtype": "float32"}
    before, after = LLM(str(base), **memory), LLM(str(tmp_path / "mqa"), **memory)
    assert after.engine.blocks.num_blocks == 2 * before.engine.blocks.num_blocks
    prompt = after.tokenizer("The quick brown fox").input_ids
    tokens = after.generate([prompt], GREEDY)[0].outputs[0].token_ids
    assert_greedy_matches(converted, prompt, tokens, tie=1e-4)


def test_kv_heads_must_divide_the_models():
    config = {"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64}
    with pytest.raises(ConfigError, match="--kv-heads 3 must divide the model's 2 KV heads"):
        pool_kv_heads(config, {}, 3)


def test_distillation_lowers_the_loss_and_the_divergence_on_a_tiny_model(tmp_path):
    """The converted model trained back toward the original's top-20 distributions: the loss goes down, the
    held-out KL with it, and the distilled weights are what is written (and served)."""
    base = make_tiny_checkpoint(tmp_path / "base", "llama")
    out = tmp_path / "mqa"
    assert main(["retrofit", "--model", str(base), "--out", str(out), "--eval-prompts", "4", "--dtype", "float32",
                 "--distill-prompts", "48", "--distill-tokens", "16", "--epochs", "6", "--lr", "3e-3",
                 "--train", "attention", "--no-progress"]) == 0
    report = json.loads((out / "retrofit_report.json").read_text())
    run = report["distillation"]
    assert run["steps"] == run["planned_steps"] > 0 and run["last_loss"] < run["first_loss"]
    assert report["distilled"]["kl_mean"] < report["converted"]["kl_mean"]
    assert run["trained"] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    served = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert served.config.num_key_value_heads == 1
    llm = LLM(str(out), dtype="float32")
    prompt = llm.tokenizer("The quick brown fox").input_ids
    assert_greedy_matches(served, prompt, llm.generate([prompt], GREEDY)[0].outputs[0].token_ids, tie=1e-4)


def test_a_zero_budget_trains_nothing(tmp_path):
    base = make_tiny_checkpoint(tmp_path / "base", "llama")
    assert main(["retrofit", "--model", str(base), "--out", str(tmp_path / "mqa"), "--eval-prompts", "2",
                 "--dtype", "float32", "--distill-prompts", "8", "--distill-tokens", "8", "--distill-minutes", "0",
                 "--no-progress"]) == 0
    report = json.loads((tmp_path / "mqa" / "retrofit_report.json").read_text())
    assert report["distillation"]["steps"] == 0 < report["distillation"]["planned_steps"]
    assert report["distilled"]["kl_mean"] == report["converted"]["kl_mean"]
