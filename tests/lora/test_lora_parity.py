"""Adapters served in one batch equal HF PEFT's merged models (greedy fp32 tokens, logits within 1e-3), whatever
the mix of adapters and base rows; a reload under the same name never meets the old adapter's cached KV."""

import shutil

import pytest
import torch

from kvyard import LLM, SamplingParams
from tests.conftest import assert_greedy_matches, hf_reference
from tests.lora.adapters import make_adapter, merged_reference

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
LOGIT_ATOL = 1e-3
# Three adapters of different ranks and targets: plain; rank and alpha by pattern (a regex target); rsLoRA
ADAPTERS = {
    "plain": dict(r=4, target_modules=["q_proj", "v_proj"]),
    "patterned": dict(r=2, lora_alpha=4, target_modules=r".*\.(k_proj|o_proj|down_proj)",
                      rank_pattern={"down_proj": 6}, alpha_pattern={"o_proj": 16}),
    "everything": dict(r=8, lora_alpha=16, use_rslora=True,
                       target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
}


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def served(request, tiny_checkpoint, tmp_path_factory):
    base = tiny_checkpoint(request.param)
    root = tmp_path_factory.mktemp(f"adapters-{request.param}")
    paths = {name: make_adapter(base, root / name, seed=i, **kw) for i, (name, kw) in enumerate(ADAPTERS.items())}
    llm = LLM(str(base), dtype="float32", lora_adapters={n: str(p) for n, p in paths.items()},
              max_num_batched_tokens=24)  # prompts in chunks, beside other rows
    return base, paths, llm


def _prompts(llm: LLM) -> list[list[int]]:
    texts = ["The quick brown fox", "Paged attention keeps the KV cache in blocks.", "x", "def add(a, b):"]
    return [llm.tokenizer(t).input_ids for t in texts]


def test_each_adapter_equals_peft_merged(served):
    base, paths, llm = served
    for name, path in paths.items():
        ref = merged_reference(base, path)
        for prompt in _prompts(llm):
            out = llm.generate([prompt], GREEDY, lora=name)[0].outputs[0].token_ids
            assert_greedy_matches(ref, prompt, out, tie=1e-4)
            with torch.no_grad():
                theirs = ref(torch.tensor([prompt])).logits[0, -1]
            assert (llm.engine.compute_logits(prompt, lora=name) - theirs).abs().max().item() <= LOGIT_ATOL


def test_a_mixed_batch_gives_every_row_its_own_tokens(served):
    """Base rows and three adapters of ranks 2 to 8 in one continuous batch: each as if it ran alone."""
    base, _, llm = served
    prompts = _prompts(llm)
    names = [None, "plain", "patterned", "everything"]
    jobs = [(p, n) for p in prompts for n in names]
    batched = [o.outputs[0].token_ids for o in llm.generate([p for p, _ in jobs], GREEDY, lora=[n for _, n in jobs])]
    alone = [llm.generate([p], GREEDY, lora=n)[0].outputs[0].token_ids for p, n in jobs]
    assert batched == alone
    ref = hf_reference(base)
    for (prompt, name), tokens in zip(jobs, batched, strict=True):
        if name is None:  # the base rows are the base model's
            assert_greedy_matches(ref, prompt, tokens, tie=1e-4)
    # the adapters change what is generated (a test that could not tell them apart would prove nothing)
    assert len({tuple(t) for (p, _), t in zip(jobs, batched, strict=True) if p == prompts[0]}) == len(names)


def test_reloading_under_the_same_name_never_serves_stale_kv(tiny_checkpoint, tmp_path):
    base = tiny_checkpoint("llama")
    first = make_adapter(base, tmp_path / "first", seed=1)
    second = make_adapter(base, tmp_path / "second", seed=2)
    served = tmp_path / "served"
    shutil.copytree(first, served)
    llm = LLM(str(base), dtype="float32", lora_adapters={"tuned": str(served)})
    prompt = list(range(3, 60))  # several full blocks: the prefix cache keeps them
    before = llm.generate([prompt], GREEDY, lora="tuned")[0].outputs[0].token_ids
    shutil.rmtree(served)
    shutil.copytree(second, served)
    llm.engine.load_lora("tuned", str(served))
    after = llm.generate([prompt], GREEDY, lora="tuned")[0].outputs[0].token_ids
    fresh = LLM(str(base), dtype="float32", lora_adapters={"tuned": str(second)})
    assert after == fresh.generate([prompt], GREEDY, lora="tuned")[0].outputs[0].token_ids
    assert after != before
