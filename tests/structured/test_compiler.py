"""Specs and their compilation: every kind compiles, bad input is a typed 400-style error, the cache
answers repeats, and a pathological grammar times out cleanly."""

import asyncio

import pytest

from kvyard.errors import InvalidRequestError
from kvyard.structured.compiler import GrammarCompileError, GrammarCompiler, GrammarTimeoutError
from kvyard.structured.matcher import GrammarState
from kvyard.structured.spec import MAX_JSON_WHITESPACE, StructuredOutput


def pathological_schema(n: int = 1000) -> dict:
    """A thousand required fields, each with its own pattern: seconds of compiling, whatever the vocabulary."""
    return {
        "type": "object",
        "required": [f"p{i}" for i in range(n)],
        "properties": {f"p{i}": {"type": "string", "pattern": f"[a-z]{{{i % 50 + 1}}}x"} for i in range(n)},
    }


def test_spec_equality_and_key_ignore_the_attachments():
    a = StructuredOutput.json_schema({"type": "object", "properties": {"x": {"type": "integer"}}})
    b = StructuredOutput.json_schema(
        '{"type": "object", "properties": {"x": {"type": "integer"}}}', param="guided_json"
    )
    b.compiled = object()
    assert a == b and a.key == b.key
    assert a.key != StructuredOutput.regex("x").key
    assert StructuredOutput.choice(["a", "b"]).choices == ["a", "b"]
    assert (
        StructuredOutput.grammar('start: "a"').is_lark
        and not StructuredOutput.grammar('root ::= "a"').is_lark
    )


@pytest.mark.parametrize(
    ("make", "param"),
    [
        (lambda: StructuredOutput.json_schema("{not json"), "response_format"),
        (lambda: StructuredOutput.json_schema([1, 2]), "response_format"),
        (lambda: StructuredOutput.choice([]), "choice"),
        (lambda: StructuredOutput.choice(["a", ""]), "choice"),
        (lambda: StructuredOutput.regex("  "), "regex"),
        (lambda: StructuredOutput.json_schema({"x": float("nan")}), "response_format"),
    ],
)
def test_malformed_specs_are_rejected_before_compiling(make, param):
    with pytest.raises(InvalidRequestError) as e:
        make()
    assert e.value.param == param


def test_every_kind_compiles_and_matches(compiler):
    cases = [
        (StructuredOutput.json_object(), '{"a": [1, null]}'),
        (
            StructuredOutput.json_schema(
                {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
            ),
            '{"n": 42}',
        ),
        (StructuredOutput.regex(r"[a-c]+-\d"), "abc-7"),
        (StructuredOutput.choice(["red", 'say "hi"', "naïve"]), 'say "hi"'),
        (StructuredOutput.grammar('root ::= "(" [0-9]+ ")"'), "(12)"),
        (StructuredOutput.grammar('start: "x" NUM\nNUM: /[0-9]+/'), "x42"),
        (
            StructuredOutput.structural_tag(
                {
                    "type": "structural_tag",
                    "format": {
                        "type": "tag",
                        "begin": "<a>",
                        "content": {"type": "json_schema", "json_schema": {"type": "integer"}},
                        "end": "</a>",
                    },
                }
            ),
            "<a>7</a>",
        ),
    ]
    for spec, text in cases:
        matcher = GrammarState(compiler.compile(spec))._matcher
        assert matcher.accept_string(text) and matcher.is_completed(), (spec.kind, text)


def test_json_object_rejects_arrays_and_schemas_reject_extra_fields(compiler):
    assert not GrammarState(compiler.compile(StructuredOutput.json_object()))._matcher.accept_string("[1]")
    strict = StructuredOutput.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}})
    assert not GrammarState(compiler.compile(strict))._matcher.accept_string('{"b": 1}')


def test_json_whitespace_is_compact_by_default_and_bounded_when_any(tiny_tokenizer, tiny_vocab_size):
    def accepts(compiler: GrammarCompiler, spec: StructuredOutput, text: str) -> bool:
        matcher = GrammarState(compiler.compile(spec))._matcher
        return matcher.accept_string(text) and matcher.is_completed()

    eos = [tiny_tokenizer.eos_token_id or 0]
    compact = GrammarCompiler(tiny_tokenizer, tiny_vocab_size, eos)
    free = GrammarCompiler(tiny_tokenizer, tiny_vocab_size, eos, json_whitespace="any")
    schema = StructuredOutput.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}})
    for spec in (schema, StructuredOutput.json_object()):
        assert accepts(compact, spec, '{"a": 1}') and accepts(free, spec, '{"a": 1}')
        for loose in ('{"a":1}', '{"a":  1}', '{ "a": 1}', '{\n  "a": 1\n}'):
            assert not accepts(compact, spec, loose) and accepts(free, spec, loose), loose
        gap = " " * MAX_JSON_WHITESPACE
        assert accepts(free, spec, '{"a":' + gap + "1}")
        assert not accepts(free, spec, '{"a":' + gap + " 1}")  # one more than the bound
    with pytest.raises(ValueError, match="json_whitespace"):
        GrammarCompiler(tiny_tokenizer, tiny_vocab_size, eos, json_whitespace="loose")


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        (StructuredOutput.json_schema({"type": "foo"}, param="response_format.json_schema.schema"), "foo"),
        (StructuredOutput.json_schema({"$ref": "#/$defs/missing"}, param="guided_json"), "missing"),
        (StructuredOutput.regex("(ab", param="guided_regex"), "parenthesis"),
        (StructuredOutput.regex("(?<=a)b", param="guided_regex"), "Lookbehind"),
        (StructuredOutput.grammar('root ::= "a" |', param="guided_grammar"), "EBNF"),
        (StructuredOutput.grammar("rule ::= x", param="guided_grammar"), "root"),
        (StructuredOutput.structural_tag({"type": "structural_tag", "format": {"type": "nope"}}), "format"),
    ],
)
def test_invalid_grammars_name_their_parameter(compiler, spec, fragment):
    with pytest.raises(GrammarCompileError) as e:
        compiler.compile(spec)
    assert e.value.param == spec.param
    assert fragment.lower() in str(e.value).lower()
    assert "/project/cpp" not in str(e.value)  # xgrammar's source locations are not for clients
    assert compiler.stats.failures >= 1


def test_cache_hits_return_the_same_grammar(compiler):
    spec = StructuredOutput.json_schema({"type": "array", "items": {"type": "boolean"}})
    first = compiler.compile(spec)
    again = compiler.compile(StructuredOutput.json_schema({"type": "array", "items": {"type": "boolean"}}))
    assert again is first
    assert compiler.stats.compiled == 1 and compiler.stats.cache_hits == 1


def test_cache_is_bounded(compiler):
    compiler.cache_entries = 2
    specs = [StructuredOutput.regex(f"x{i}") for i in range(3)]
    first = compiler.compile(specs[0])
    for spec in specs[1:]:
        compiler.compile(spec)
    assert compiler.compile(specs[0]) is not first  # evicted, compiled again
    assert compiler.stats.compiled == 4


def test_pathological_grammar_times_out_cleanly(compiler):
    compiler.timeout_s = 0.05
    spec = StructuredOutput.json_schema(pathological_schema(), param="guided_json")
    with pytest.raises(GrammarTimeoutError) as e:
        compiler.compile(spec)
    assert e.value.param == "guided_json" and "longer than" in str(e.value)
    with pytest.raises(GrammarTimeoutError):  # awaiting it times out the same way, and shares the compile
        asyncio.run(compiler.compile_async(spec))
    assert compiler.stats.timeouts == 2
    # Meanwhile other grammars still compile (a second compile thread may run).
    compiler.timeout_s = 120
    assert compiler.compile(StructuredOutput.regex("ok")) is not None
    # The slow compile went on in the background; waiting long enough gets its result, compiled once.
    compiled = compiler.compile(spec)
    assert compiler.compile(spec) is compiled and compiler.stats.cache_hits >= 1


def test_attach_compiles_once(compiler):
    spec = StructuredOutput.choice(["a", "b"])
    attached = asyncio.run(compiler.attach(spec))
    assert attached is spec and spec.compiled is not None
    compiled = spec.compiled
    asyncio.run(compiler.attach(spec))
    assert spec.compiled is compiled
