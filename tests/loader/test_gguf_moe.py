"""MoE GGUF files, converted as llama.cpp does (experts stacked into `ffn_*_exps`): the same config and tensors as
the HF directory they came from, and the same greedy tokens."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from kvyard import LLM, SamplingParams
from kvyard.loader.gguf_file import load_gguf
from kvyard.loader.hf_dir import expected_tensor_names
from kvyard.models.config import ModelConfig
from tests.conftest import hf_greedy, hf_reference
from tests.loader.tiny_gguf import Q, hf_state_dict, write_tiny_gguf

FAMILIES = ["qwen2_moe", "qwen3_moe", "mixtral"]  # olmoe: transformers reads no olmoe GGUF, so neither does kvyard


@pytest.mark.parametrize("family", FAMILIES)
def test_moe_gguf_holds_the_hf_checkpoint(tiny_checkpoint, tmp_path: Path, family: str) -> None:
    hf_dir = tiny_checkpoint(family)
    ckpt = load_gguf(write_tiny_gguf(hf_dir, tmp_path / "moe.gguf"))
    hf_cfg = ModelConfig.from_hf(json.loads((hf_dir / "config.json").read_text()))
    assert ckpt.config == hf_cfg and hf_cfg.num_experts == 4
    ours, orig = dict(ckpt.tensors()), hf_state_dict(hf_dir)
    assert set(ours) == set(expected_tensor_names(ckpt.config)) == set(orig)
    for name, t in ours.items():
        np.testing.assert_array_equal(t.numpy(), orig[name], err_msg=name)


def test_moe_gguf_generates_what_the_hf_model_does(tiny_checkpoint, tmp_path: Path) -> None:
    hf_dir = tiny_checkpoint("qwen2_moe")  # a dense first layer, a shared expert, attention biases
    llm = LLM(str(write_tiny_gguf(hf_dir, tmp_path / "moe.gguf", Q.F32)), dtype="float32")
    ref = hf_reference(hf_dir)
    for text in ("The quick brown fox", "def add(a, b):"):
        prompt = llm.tokenizer(text).input_ids
        out = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
        assert out.outputs[0].token_ids == hf_greedy(ref, prompt, 16)
        with torch.no_grad():
            theirs = ref(torch.tensor([prompt])).logits[0, -1]
        assert (llm.engine.compute_logits(prompt) - theirs).abs().max().item() <= 1e-4
