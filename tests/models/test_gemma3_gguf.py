"""The real Gemma 3 270M (a Q4_K_M GGUF, fetched like the default model) against transformers on the same file:
greedy fp32 tokens identical and last logits within tolerance, with a prompt past the 512-token window that
prefills in chunks."""

import pytest
import torch

from kvyard import LLM, SamplingParams
from tests.conftest import hf_greedy, hf_reference_gguf

NEW_TOKENS = 24
LOGIT_ATOL = 1e-3  # measured on a Zen 4 EPYC: 1.5e-5 to 2.7e-5


@pytest.fixture(scope="module")
def gemma_path():
    from kvyard.loader.registry import resolve_model

    return resolve_model("gemma3-270m")


@pytest.mark.slow  # 116 s, most of it transformers reading the GGUF; test_parity's tiny gemma3_text stays in CI
def test_gemma3_270m_matches_transformers(gemma_path):
    llm = LLM(str(gemma_path), dtype="float32", max_num_batched_tokens=256)
    assert llm.engine.model_config.layer_windows.count(512) == 15  # 5 of every 6 of its 18 layers slide
    texts = ["The capital of France is", "def fibonacci(n):",
             " ".join(f"Item {i} is a {['red', 'blue', 'green'][i % 3]} box." for i in range(80)) + " Item 80 is"]
    prompts = [llm.tokenizer(t).input_ids for t in texts]
    assert len(prompts[2]) > 600
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    ref = hf_reference_gguf(gemma_path)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(ref, prompt, NEW_TOKENS)
    for prompt in prompts:
        with torch.no_grad():
            theirs = ref(torch.tensor([prompt])).logits[0, -1].float()
        assert (llm.engine.compute_logits(prompt) - theirs).abs().max().item() <= LOGIT_ATOL
