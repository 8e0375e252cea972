"""Matcher state and batch masking: constrained rows allow exactly the grammar's tokens, unconstrained
rows are untouched, a terminated grammar ends the request, and rollback restores earlier states."""

import torch

from kvyard.engine.request import Request
from kvyard.engine.sampler import sample
from kvyard.sampling_params import SamplingParams
from kvyard.structured.bitmask import apply_grammar_bitmask
from kvyard.structured.matcher import GrammarState
from kvyard.structured.spec import StructuredOutput


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def _allowed(tokenizer, row: torch.Tensor) -> set[str]:
    return {tokenizer.decode([i]) for i in torch.isfinite(row).nonzero().flatten().tolist()}


def test_bitmask_masks_constrained_rows_only(compiler, tiny_tokenizer, tiny_vocab_size):
    state = GrammarState(compiler.compile(StructuredOutput.choice(["yes", "no"])))
    logits = torch.randn(3, tiny_vocab_size)
    before = logits.clone()
    rows = apply_grammar_bitmask(logits, [None, state, None])
    assert rows == [1]
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    allowed = _allowed(tiny_tokenizer, logits[1])
    assert allowed and all("yes".startswith(t) or "no".startswith(t) for t in allowed)
    assert torch.equal(logits[1][torch.isfinite(logits[1])], before[1][torch.isfinite(logits[1])])


def test_bitmask_on_bfloat16_logits(compiler, tiny_vocab_size):
    state = GrammarState(compiler.compile(StructuredOutput.regex("[0-9]")))
    logits = torch.randn(2, tiny_vocab_size, dtype=torch.bfloat16)
    apply_grammar_bitmask(logits, [state, None])
    assert 0 < int(torch.isfinite(logits[0]).sum()) < tiny_vocab_size
    assert bool(torch.isfinite(logits[1]).all())


def test_accept_terminate_and_rollback(compiler, tiny_tokenizer):
    eos = tiny_tokenizer.eos_token_id
    state = GrammarState(
        compiler.compile(
            StructuredOutput.json_schema(
                {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
            )
        )
    )
    tokens = _ids(tiny_tokenizer, '{"city": "Paris"}')
    assert all(state.accept(t) for t in tokens)
    assert state.completed and not state.terminated
    state.rollback(2)  # as after a rejected two-token draft
    assert not state.completed and state.num_accepted == len(tokens) - 2
    assert all(state.accept(t) for t in tokens[-2:])
    assert not state.accept(_ids(tiny_tokenizer, "x")[0])  # nothing may follow the closing brace but a stop
    assert state.accept(eos) and state.terminated


def test_sampler_picks_only_allowed_tokens_in_a_mixed_batch(compiler, tiny_tokenizer, tiny_vocab_size):
    spec = StructuredOutput.regex("[0-9]+")
    reqs = []
    for i, temperature in enumerate([0.0, 1.0, 0.0, 1.0]):
        params = SamplingParams(
            temperature=temperature, seed=i, min_tokens=2, structured_output=spec if i % 2 else None
        )
        req = Request(f"r{i}", [1, 2, 3], params, eos_token_ids=(tiny_tokenizer.eos_token_id,))
        if i % 2:
            req.grammar = GrammarState(compiler.compile(spec))
        reqs.append(req)
    torch.manual_seed(0)
    for _ in range(5):
        logits = torch.randn(4, tiny_vocab_size)
        free_argmax = int(logits[2].argmax())
        tokens = sample(logits, reqs).token_ids
        assert tokens[2] == free_argmax  # an unconstrained greedy row is untouched
        for i in (1, 3):
            assert reqs[i].grammar.accept(tokens[i])
            assert tiny_tokenizer.decode([tokens[i]]).isdigit() or tokens[i] == tiny_tokenizer.eos_token_id
