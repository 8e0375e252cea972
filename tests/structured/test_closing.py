"""The closing path and the budget steering (kvyard/structured/closing.py) on the tiny tokenizer: the path's
length, the path leaves the request's own state alone, and near the end of the budget a row keeps only
tokens after which the grammar still completes in time, so that sampling anything it allows closes it."""

import json
import re

import pytest
import torch

from kvyard.structured.matcher import GrammarState
from kvyard.structured.spec import StructuredOutput


def _state(compiler, spec: StructuredOutput) -> GrammarState:
    return GrammarState(compiler.compile(spec))


@pytest.mark.parametrize("spec, text", [
    (StructuredOutput.json_object(), "{}"),
    (StructuredOutput.regex(r"[A-Z][a-z]{2,8} [0-9]{1,3}"), None),
    (StructuredOutput.grammar('root ::= "(" num ("," num)* ")"\nnum ::= [1-9] [0-9]?'), None),
    (StructuredOutput.json_schema({"type": "object", "properties": {"a": {"type": "integer"}},
                                   "required": ["a"]}), None),
])
def test_the_path_completes_and_leaves_the_state_alone(compiler, spec, text):
    state = _state(compiler, spec)
    n = state.tokens_to_close(100)
    assert n is not None and 0 < n <= 12
    assert state.tokens_to_close(n - 1) is None and state.tokens_to_close(n) == n  # limit is exact
    assert state.num_accepted == 0 and not state.completed  # it ran on a fork


def _sample_under_budget(state: GrammarState, vocab: int, budget: int, seed: int) -> list[int]:
    """Sample tokens the grammar allows with the steering on, at random logits, until the budget runs out."""
    from kvyard.structured.bitmask import apply_grammar_bitmask

    gen = torch.Generator().manual_seed(seed)
    tokens = []
    for used in range(budget):
        if state.terminated:
            break
        row = torch.randn(1, vocab, generator=gen) * 3
        apply_grammar_bitmask(row, [state])
        state.steer(row[0], budget - used)
        token = int(torch.multinomial(row[0].softmax(-1), 1, generator=gen))
        assert state.accept(token)
        tokens.append(token)
    return tokens


def test_random_sampling_under_a_tight_budget_always_closes(compiler, tiny_tokenizer, tiny_vocab_size):
    """Random logits write long strings and numbers; the steering still closes every one in its budget."""
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"},
                                               "tags": {"type": "array", "items": {"type": "string"}}},
              "required": ["name", "n", "tags"]}
    spec = StructuredOutput.json_schema(schema)
    need = _state(compiler, spec).tokens_to_close(1000)
    forced = 0
    for seed in range(12):
        state = _state(compiler, spec)
        budget = need + seed
        tokens = _sample_under_budget(state, tiny_vocab_size, budget, seed)
        text = tiny_tokenizer.decode([t for t in tokens if t != tiny_tokenizer.eos_token_id])
        assert state.completed or state.terminated, (budget, text)
        value = json.loads(text)
        assert set(value) >= {"name", "n", "tags"} and len(tokens) <= budget
        forced += state.budget_forced
    assert forced >= 6  # random logits would not have closed in time by themselves


def test_without_steering_random_sampling_is_cut(compiler, tiny_vocab_size):
    """The same setting with the steering off: the budget cuts most outputs (so the test above means something)."""
    spec = StructuredOutput.json_schema({"type": "object", "properties": {"name": {"type": "string"}},
                                         "required": ["name"]})
    need = _state(compiler, spec).tokens_to_close(1000)
    cut = 0
    for seed in range(12):
        state = _state(compiler, spec)
        state.steer = lambda row, left: None  # type: ignore[method-assign]
        _sample_under_budget(state, tiny_vocab_size, need + 4, seed)
        cut += not (state.completed or state.terminated)
    assert cut >= 6


def test_a_regex_closes_too(compiler, tiny_tokenizer, tiny_vocab_size):
    spec = StructuredOutput.regex(r"[a-z]{1,20}-[0-9]{1,4}")
    need = _state(compiler, spec).tokens_to_close(100)
    for seed in range(6):
        state = _state(compiler, spec)
        tokens = _sample_under_budget(state, tiny_vocab_size, need + 1, seed)
        text = tiny_tokenizer.decode([t for t in tokens if t != tiny_tokenizer.eos_token_id])
        assert re.fullmatch(r"[a-z]{1,20}-[0-9]{1,4}", text), text
