"""Parity on the real default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against HF on the same file."""

import pytest
import torch

from kvyard import LLM, SamplingParams
from tests.conftest import hf_greedy, hf_reference_gguf

MESSAGES = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Give me three tips for sleeping better, as a numbered list, and explain each in a sentence.",
]


@pytest.fixture(scope="module")
def engines(smollm2_path):
    return {
        "chunked": LLM(str(smollm2_path), dtype="float32", max_num_batched_tokens=48),
        "whole": LLM(str(smollm2_path), dtype="float32", enable_chunked_prefill=False),
    }


@pytest.fixture(scope="module")
def prompts(engines):
    llm = engines["whole"]
    return [llm.chat_prompt([{"role": "user", "content": m}]) for m in MESSAGES]


@pytest.mark.parametrize("mode", ["chunked", "whole"])
def test_greedy_matches_transformers(engines, prompts, smollm2_path, mode):
    outs = engines[mode].generate(prompts, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    ref = hf_reference_gguf(smollm2_path)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(ref, prompt, 32)


def test_logits_within_tolerance(engines, prompts, smollm2_path):
    ref = hf_reference_gguf(smollm2_path)
    for prompt in prompts:
        ours = engines["whole"].engine.compute_logits(prompt)
        with torch.no_grad():
            theirs = ref(torch.tensor([prompt])).logits[0, -1].float()
        assert (ours - theirs).abs().max().item() <= 1e-3


def test_chat_template_and_eos_come_from_gguf(engines):
    llm = engines["whole"]
    assert "<|im_start|>" in llm.tokenizer.chat_template
    out = llm.chat([{"role": "user", "content": "Say hello."}], SamplingParams(max_tokens=64, temperature=0))
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].text.strip()
