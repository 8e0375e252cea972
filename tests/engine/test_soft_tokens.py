"""Soft tokens (a grafted image's embeddings at placeholder positions): exact where they equal the tokens'
own embeddings, whatever the chunking; their digest keys the prefix cache; bad spans are refused."""

import hashlib

import pytest
import torch

from kvyard import LLM, SamplingParams
from kvyard.engine.block_manager import block_hashes, extend_block_hashes
from kvyard.engine.soft_tokens import SoftTokens
from kvyard.errors import InvalidRequestError

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
PROMPT = list(range(3, 40))  # 37 tokens
PLACEHOLDER = 0


@pytest.fixture(scope="module")
def path(tiny_checkpoint):
    return str(tiny_checkpoint("llama"))


def run(llm: LLM, ids: list[int], soft: list[SoftTokens] | None = None) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs."""
    rid = llm.engine.add_request(ids, GREEDY, soft_tokens=soft)
    done = {}
    while llm.engine.has_unfinished_requests():
        done.update({o.request_id: o for o in llm.engine.step() if o.finished})
    out = done[rid].outputs[0]
    return out.token_ids, [lp.logprob for lp in out.logprobs]


def as_soft(llm: LLM, start: int, end: int, digest: bytes = b"image") -> tuple[list[int], SoftTokens]:
    """The prompt with [start, end) replaced by placeholders, and soft tokens holding those tokens' embeddings."""
    rows = llm.engine.runner.model.embed_tokens(torch.tensor(PROMPT[start:end])).clone()
    ids = PROMPT[:start] + [PLACEHOLDER] * (end - start) + PROMPT[end:]
    return ids, SoftTokens(start, rows, hashlib.sha256(digest).digest())


@pytest.mark.parametrize("chunk", [64, 8])  # one prefill, or chunks that cut the span
def test_soft_tokens_equal_to_token_embeddings_give_the_plain_prompts_tokens(path, chunk):
    llm = LLM(path, dtype="float32", block_size=4, max_num_batched_tokens=chunk, enable_prefix_caching=False)
    tokens, logprobs = run(llm, PROMPT)
    ids, soft = as_soft(llm, 5, 17)
    got_tokens, got_logprobs = run(llm, ids, [soft])
    assert got_tokens == tokens
    assert got_logprobs == pytest.approx(logprobs, abs=1e-5)
    # The placeholders alone are another prompt: the soft tokens did the work
    assert run(llm, ids)[1] != pytest.approx(logprobs, abs=1e-3)


def test_the_digest_keys_the_prefix_cache(path):
    llm = LLM(path, dtype="float32", block_size=4)
    ids, soft = as_soft(llm, 9, 13)  # blocks 2 and 3 hold the span
    first, _ = run(llm, ids, [soft])
    blocks = llm.engine.blocks
    hits = blocks.hit_tokens
    assert run(llm, ids, [soft])[0] == first and blocks.hit_tokens - hits == 36  # the same image: all but the last
    other = SoftTokens(9, soft.embeds.flip(0), hashlib.sha256(b"another image").digest())
    hits = blocks.hit_tokens
    run(llm, ids, [other])
    assert blocks.hit_tokens - hits == 8  # only the two blocks before the image are shared
    hits = blocks.hit_tokens
    run(llm, ids)  # no image at all: the placeholders' KV is not the image's
    assert blocks.hit_tokens - hits == 8


def test_a_prompt_without_soft_tokens_hashes_as_before():
    assert extend_block_hashes([], PROMPT, 4, b"", 9, ()) == block_hashes(PROMPT, 4)
    soft = SoftTokens(9, torch.zeros(4, 8), b"d")
    with_image = extend_block_hashes([], PROMPT, 4, b"", 9, [soft])
    assert with_image[:2] == block_hashes(PROMPT, 4)[:2] and not set(with_image[2:]) & set(block_hashes(PROMPT, 4))


def test_bad_spans_are_refused(path):
    llm = LLM(path, dtype="float32")
    hidden = llm.engine.model_config.hidden_size
    for span in [SoftTokens(35, torch.zeros(4, hidden), b"x"), SoftTokens(0, torch.zeros(4, hidden + 1), b"x")]:
        with pytest.raises(InvalidRequestError):
            llm.engine.add_request(PROMPT, GREEDY, soft_tokens=[span])
    assert not llm.engine.has_unfinished_requests()
