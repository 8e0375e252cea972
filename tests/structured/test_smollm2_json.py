"""The real SmolLM2 model under JSON schemas: every constrained generation parses and validates.

Not a rate: 100%. 204 constrained generations over six schemas (nested objects, arrays, enums,
numbers with ranges, required and optional fields, a pattern) at temperature 0 and 1, in one batch
with unconstrained requests, through the offline API; six more under ngram speculation. Schemas bound
their strings and arrays, so a generation always ends within max_tokens; the test checks that too
(finish_reason "stop").
"""

import json
import re

import jsonschema
import pytest

from kvyard import LLM, SamplingParams
from kvyard.structured import StructuredOutput

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "maxLength": 24},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city"],
        },
    },
    "required": ["name", "age", "address"],
}
ORDER = {
    "type": "object",
    "properties": {
        "order_id": {"type": "integer", "minimum": 1, "maximum": 99999},
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "enum": ["apple", "bread", "milk", "eggs"]},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 12},
                },
                "required": ["sku", "quantity"],
            },
        },
        "express": {"type": "boolean"},
    },
    "required": ["order_id", "items"],
}
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "temperature": {"type": "number", "minimum": -50, "maximum": 60},
        "conditions": {"type": "string", "enum": ["sunny", "cloudy", "rain", "snow"]},
    },
    "required": ["city", "unit", "temperature", "conditions"],
}
EVENT = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 20},
        "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
        "attendees": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "priority": {"type": "integer", "minimum": 1, "maximum": 5},
    },
    "required": ["title", "date"],
}
REVIEW = {
    "type": "object",
    "properties": {
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "summary": {"type": "string", "maxLength": 24},
        "pros": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 2},
        "recommend": {"type": "boolean"},
        "scores": {
            "type": "object",
            "properties": {
                "quality": {"type": "integer", "minimum": 0, "maximum": 10},
                "price": {"type": "integer", "minimum": 0, "maximum": 10},
            },
            "required": ["quality"],
        },
    },
    "required": ["rating", "summary", "scores"],
}
COORDS = {
    "type": "array",
    "minItems": 1,
    "maxItems": 3,
    "items": {
        "type": "object",
        "properties": {
            "lat": {"type": "integer", "minimum": -90, "maximum": 90},
            "lon": {"type": "integer", "minimum": -180, "maximum": 180},
            "label": {"type": ["string", "null"], "maxLength": 10},
        },
        "required": ["lat", "lon"],
    },
}
SCHEMAS = {
    "person": PERSON,
    "order": ORDER,
    "weather": WEATHER,
    "event": EVENT,
    "review": REVIEW,
    "coords": COORDS,
}
PROMPTS = {
    "person": "Describe a fictional person as JSON.",
    "order": "Write a grocery order as JSON.",
    "weather": "Report today's weather in a city as JSON.",
    "event": "Plan a meeting and give it as JSON.",
    "review": "Review a coffee machine as JSON.",
    "coords": "List a few places with their coordinates as JSON.",
}
PER_SCHEMA = 34  # 6 x 34 = 204 constrained generations
MAX_TOKENS = 128


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return LLM(
        str(smollm2_path),
        dtype="float32",
        kv_cache_memory="1GiB",  # room for every running sequence: no preemption
        max_num_seqs=128,
        max_num_batched_tokens=1024,
        num_threads=2,
    )


def _params(name: str, i: int) -> SamplingParams:
    spec = StructuredOutput.json_schema(SCHEMAS[name])
    # A quarter greedy, the rest sampled at temperature 1 with their own seeds.
    temperature = 0.0 if i % 4 == 0 else 1.0
    return SamplingParams(
        max_tokens=MAX_TOKENS, temperature=temperature, seed=1000 + i, structured_output=spec
    )


@pytest.mark.slow  # 35 s: the whole schema suite; the speculation variant below stays in CI
def test_every_constrained_generation_validates(llm):
    prompts, params, names = [], [], []
    for name in SCHEMAS:
        prompt = llm.chat_prompt([{"role": "user", "content": PROMPTS[name]}])
        for i in range(PER_SCHEMA):
            prompts.append(prompt)
            params.append(_params(name, i))
            names.append(name)
            if i % 8 == 0:  # unconstrained neighbours in the same batch
                prompts.append(prompt)
                params.append(SamplingParams(max_tokens=24, temperature=1.0, seed=i))
                names.append(None)
    outs = llm.generate(prompts, params)
    checked = 0
    free_text = []
    for name, out in zip(names, outs, strict=True):
        c = out.outputs[0]
        if name is None:
            free_text.append(c.text)
            continue
        assert c.finish_reason == "stop", (name, c.text)
        jsonschema.validate(json.loads(c.text), SCHEMAS[name])
        checked += 1
    assert checked == len(SCHEMAS) * PER_SCHEMA >= 200
    # The unconstrained neighbours really were free: at least one is not JSON at all.
    assert any(not t.lstrip().startswith(("{", "[")) for t in free_text)


def test_masking_is_row_local(llm):
    """A constrained row gets the same tokens alone or between unconstrained rows, which stay free."""
    prompt = llm.chat_prompt([{"role": "user", "content": "Pick a time."}])
    spec = StructuredOutput.regex(r"[0-2][0-9]:[0-5][0-9]")
    constrained = SamplingParams(max_tokens=12, temperature=1.0, seed=7, structured_output=spec)
    free = SamplingParams(max_tokens=6, temperature=1.0, seed=5)
    alone = llm.generate([prompt], [constrained])[0].outputs[0].text
    outs = llm.generate([prompt] * 3, [free, constrained, free])
    assert outs[1].outputs[0].text == alone
    assert re.fullmatch(r"[0-2][0-9]:[0-5][0-9]", alone)
    free_alone = llm.generate([prompt], [free])[0].outputs[0].text
    assert outs[0].outputs[0].text == outs[2].outputs[0].text == free_alone


def test_other_grammar_kinds(llm):
    prompt = llm.chat_prompt([{"role": "user", "content": "Answer: is the sky blue?"}])
    specs = [
        StructuredOutput.choice(["yes", "no", "maybe"]),
        StructuredOutput.regex(r"[A-Z][a-z]{2,8} [0-9]{1,3}"),
        StructuredOutput.grammar('root ::= "(" num ("," num)* ")"\nnum ::= [1-9] [0-9]?'),
        StructuredOutput.grammar('start: "yes" | "no"'),  # Lark
        StructuredOutput.json_object(),
    ]
    outs = llm.generate(
        [prompt] * 10,
        [
            SamplingParams(max_tokens=60, temperature=1.0, seed=s % 2, structured_output=spec)
            for s, spec in enumerate(specs * 2)
        ],
    )
    texts = [o.outputs[0].text for o in outs]
    assert all(o.outputs[0].finish_reason == "stop" for o in outs), texts

    for i in (0, 5):
        assert texts[i] in ("yes", "no", "maybe")
    for i in (1, 6):
        assert re.fullmatch(r"[A-Z][a-z]{2,8} [0-9]{1,3}", texts[i])
    for i in (2, 7):
        assert re.fullmatch(r"\([1-9][0-9]?(,[1-9][0-9]?)*\)", texts[i])
    for i in (3, 8):
        assert texts[i] in ("yes", "no")
    for i in (4, 9):
        assert isinstance(json.loads(texts[i]), dict)


def test_constrained_generations_under_speculation(llm, smollm2_path):
    """With ngram speculation, drafts the grammar forbids are rejected: outputs still validate, and greedy
    ones are token for token those without speculation."""
    spec_llm = LLM(
        str(smollm2_path),
        dtype="float32",
        kv_cache_memory="128MiB",
        num_threads=2,
        speculative_method="ngram",
        speculative_max_batch=16,
    )
    prompts, params, names = [], [], []
    for n, name in enumerate(SCHEMAS):  # every schema once, greedy (i % 4 == 0) and sampled in turn
        prompts.append(llm.chat_prompt([{"role": "user", "content": PROMPTS[name]}]))
        params.append(_params(name, n % 2))
        names.append(name)
    outs = spec_llm.generate(prompts, params)
    for name, out in zip(names, outs, strict=True):
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMAS[name])
    assert spec_llm.engine.spec.stats.proposed_tokens > 0
    greedy = [i for i, p in enumerate(params) if p.temperature == 0.0]
    plain = llm.generate([prompts[i] for i in greedy], [params[i] for i in greedy])
    assert [o.outputs[0].token_ids for o in plain] == [outs[i].outputs[0].token_ids for i in greedy]
