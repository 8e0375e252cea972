"""response_format and vLLM's guided_* through the official openai smol_client, against the real SmolLM2:
outputs validate, streamed or not; bad schemas are 400s that name the field; a pathological schema
times out as a 400, never a 500 and never an unconstrained answer."""

import json
import re

import httpx
import jsonschema
import pytest

from tests.server.harness import running_server
from tests.structured.test_compiler import pathological_schema

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "population": {"type": "integer", "minimum": 0, "maximum": 50000000},
        "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 2},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "population", "capital"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Describe a city as JSON."}]
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}


def test_json_schema_non_streaming_and_streaming(smol_client):
    r = smol_client.chat.completions.create(
        model="smol",
        messages=MESSAGES,
        response_format=RESPONSE_FORMAT,
        max_tokens=96,
        n=3,
        temperature=1.0,
        seed=3,
    )
    assert len(r.choices) == 3
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    chunks = list(
        smol_client.chat.completions.create(
            model="smol",
            messages=MESSAGES,
            response_format=RESPONSE_FORMAT,
            max_tokens=96,
            temperature=0.0,
            stream=True,
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        "stop"
    ]


def test_json_object_and_vllm_extensions(smol_client):
    r = smol_client.chat.completions.create(
        model="smol",
        messages=MESSAGES,
        response_format={"type": "json_object"},
        max_tokens=64,
        temperature=0.0,
    )
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = smol_client.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": "Is water wet?"}],
        max_tokens=8,
        temperature=1.0,
        seed=1,
        extra_body={"guided_choice": ["yes", "no"]},
    )
    assert r.choices[0].message.content in ("yes", "no")
    r = smol_client.completions.create(
        model="smol",
        prompt="The date today is",
        max_tokens=16,
        temperature=1.0,
        seed=2,
        extra_body={"guided_regex": r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"},
    )
    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", r.choices[0].text)
    r = smol_client.completions.create(
        model="smol",
        prompt="List:",
        max_tokens=16,
        temperature=0.0,
        extra_body={"structured_outputs": {"grammar": 'root ::= x ("," x)?\nx ::= "a" | "b"'}},
    )
    assert re.fullmatch(r"[ab](,[ab])?", r.choices[0].text)


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "foo"}},
                }
            },
            "response_format.json_schema.schema",
            "foo",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "json_schema"),
        ({"response_format": {"type": "yaml"}}, "response_format.type", ""),
        ({"guided_regex": "(unclosed"}, "guided_regex", "parenthesis"),
        ({"guided_json": {"$ref": "#/nowhere"}}, "guided_json", "nowhere"),
        ({"guided_grammar": "root ::= "}, "guided_grammar", "ebnf"),
        ({"guided_choice": []}, "guided_choice", "choice"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "only one"),
    ],
)
def test_invalid_constraints_are_400s_naming_the_field(smol_server, body, param, fragment):
    r = httpx.post(
        smol_server.url + "/v1/chat/completions", timeout=30, json={"messages": MESSAGES, "max_tokens": 4, **body}
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert fragment.lower() in error["message"].lower()


def test_pathological_schema_times_out_as_a_400(engine):
    """On the tiny model (a slow compile of a big vocabulary would hold up the test process's exit)."""
    with running_server(engine) as srv:
        srv.ctx.grammars.timeout_s = 0.05
        body = {"prompt": "x", "max_tokens": 4, "guided_json": pathological_schema()}
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "guided_json" and "longer than" in r.json()["error"]["message"]
        # The server is fine: an ordinary constrained request still works at once.
        r = httpx.post(
            srv.url + "/v1/completions",
            timeout=30,
            json={"prompt": "x", "max_tokens": 8, "guided_choice": ["ok"]},
        )
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ok"


def test_constrained_json_is_one_line_with_fixed_separators(smol_client):
    """The default (`--json-whitespace compact`): each answer is exactly what json.dumps writes for its value,
    so no newline, no indentation, no run of spaces a small model could loop on."""
    r = smol_client.chat.completions.create(model="smol", messages=MESSAGES, response_format=RESPONSE_FORMAT,
                                            max_tokens=96, n=4, temperature=1.0, seed=11)
    for choice in r.choices:
        text = choice.message.content
        assert text == json.dumps(json.loads(text), ensure_ascii=False), text


def test_json_whitespace_any_reaches_the_compiler(smollm2_engine):
    with running_server(smollm2_engine, served_model_name="smol", json_whitespace="any") as srv:
        body = {"model": "smol", "messages": MESSAGES, "max_tokens": 96, "temperature": 0.0,
                "response_format": RESPONSE_FORMAT}
        r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200
        jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), SCHEMA)
        assert srv.ctx.grammars.json_whitespace == "any"
        assert srv.ctx.grammars._compiler is not None and srv.ctx.grammars._compiler.json_whitespace == "any"
