"""Hundreds of client mistakes: every one is a 4xx with an OpenAI error body, never a 5xx."""

import json

import httpx
import pytest

from tests.server.harness import running_server, wait_until

GOOD_COMPLETION = {"prompt": "The quick", "max_tokens": 3}
GOOD_CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}

# Wrong values for fields both endpoints share.
SHARED_BAD: dict[str, list] = {
    "max_tokens": [0, -1, -100, "5", 1.5, True, [], {}, 2**40],
    "temperature": [-1, -0.01, 101, "hot", True, [], {}],
    "top_p": [0, -0.5, 1.5, "x", False],
    "n": [0, -1, 129, 1.5, "2", True],
    "stop": [5, [1], [""], {"a": 1}, [None], True],
    "seed": ["x", 1.5, 2**64, True, [1]],
    "presence_penalty": [3, -3, "x", []],
    "frequency_penalty": [2.5, -2.5, "x", {}],
    "top_k": [-2, "x", 1.5, 2**40],
    "min_p": [-0.1, 1.1, "x"],
    "repetition_penalty": [0, -1, 101, "x"],
    "ignore_eos": ["yes", 1, []],
    "min_tokens": [-1, 4, "x", 1.5],  # 4 > max_tokens 3
    "stop_token_ids": [[-1], ["a"], 5, [10**6], [1.5], [True]],
    "stream": ["yes", 1, []],
    "stream_options": ["x", 5, {"include_usage": "yes"}],
    "user": [5, [], {}],
    "model": [5, [], "gpt-4", "no-such-model"],
    "skip_special_tokens": ["no", 0],
    "logit_bias": [{"abc": 1}, {"1": 101}, {"1": -100.5}, {"1": "x"}, {"1000000": 1}, {"-1": 1}, [1], "x"],
    "prompt_logprobs": [-1, 21, "x", 1.5],
}

COMPLETION_BAD: dict[str, list] = {
    "prompt": [5, None, [], [[]], [1.5], [-1], [10**6], [[1], "a"], {"a": 1}, "", [True], ["a", 1],
               "word " * 2000, [7] * 600, ["a"] * 300],
    "logprobs": [-1, 21, "x", True, 1.5],
    "echo": ["x", 5],
    "suffix": ["x", 5],
    "best_of": [3, "x"],
}

CHAT_BAD: dict[str, list] = {
    "messages": [
        None, [], "hi", 5, {"role": "user"},
        [{"role": "wizard", "content": "x"}], [{"content": "x"}], [{"role": "user"}], [{"role": 5, "content": "x"}],
        [{"role": "user", "content": 5}], [{"role": "user", "content": ["x"]}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}],
        [{"role": "user", "content": [{"type": "text"}]}],
        [{"role": "tool", "content": "x"}],
        [{"role": "user", "content": "x", "tool_calls": [{"id": "1", "function": {"name": "f", "arguments": ""}}]}],
        [{"role": "assistant", "tool_calls": [{"id": "1"}]}],
        [{"role": "assistant", "tool_calls": [{"id": "1", "type": "web", "function": {"name": "f", "arguments": ""}}]}],
        [{"role": "user", "content": "word " * 2000}],
        [None], [[]], ["user"],
    ],
    "logprobs": ["x", 5],
    "top_logprobs": [-1, 21, "x", 3],  # 3 without logprobs: true
    "max_completion_tokens": [0, -5, "x"],
    "tools": ["x", [{"type": "function"}], [{"type": "x", "function": {"name": "f"}}], [5]],
}

RAW_BODIES = [b"", b"{", b"}", b"[]", b"null", b"5", b'"str"', b"\xff\xfe\xfd", b"{'prompt': 'x'}",
              b'{"prompt": "x",}', b"[" * 100_000, b'{"prompt": ' + b"[" * 50_000, b'{"max_tokens": NaN, "prompt": "x"}',
              b'{"temperature": Infinity, "prompt": "x"}', b'{"prompt": "x", "max_tokens": 1e400}']


def cases() -> list[tuple[str, bytes]]:
    out = []
    for path, good, specific in (("/v1/completions", GOOD_COMPLETION, COMPLETION_BAD),
                                 ("/v1/chat/completions", GOOD_CHAT, CHAT_BAD)):
        for field, values in {**SHARED_BAD, **specific}.items():
            for value in values:
                out.append((path, json.dumps({**good, field: value}).encode()))
        required = next(iter(good))  # prompt / messages
        out.append((path, json.dumps({k: v for k, v in good.items() if k != required}).encode()))
        out.extend((path, raw) for raw in RAW_BODIES)
    return out


def assert_openai_error(r: httpx.Response, status: int | None = None) -> dict:
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    if status is not None:
        assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["type"]
    return err


@pytest.fixture(scope="module")
def server(engine):
    with running_server(engine) as srv:
        yield srv


def test_hundreds_of_bad_requests_get_4xx_and_the_server_keeps_serving(server, engine):
    all_cases = cases()
    assert len(all_cases) > 250
    statuses = {}
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for path, body in all_cases:
            r = http.post(path, content=body, headers={"Content-Type": "application/json"})
            assert 400 <= r.status_code < 500, (path, body[:200], r.status_code, r.text[:300])
            assert_openai_error(r)
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        good = http.post("/v1/completions", json=GOOD_COMPLETION)
        assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] >= 1
    assert set(statuses) == {400, 404}, statuses
    def settled() -> bool:  # the engine thread publishes its stats just after the step that answered
        stats = engine.stats()
        return stats.num_open_requests == 0 and stats.num_free_blocks == stats.num_total_blocks

    assert wait_until(settled, timeout=5)


def test_specific_errors_name_the_problem(server, engine):
    with httpx.Client(base_url=server.url, timeout=30) as http:
        err = assert_openai_error(http.post("/v1/completions", json={**GOOD_COMPLETION, "max_tokens": 0}), 400)
        assert err["param"] == "max_tokens"
        err = assert_openai_error(http.post("/v1/completions", json={**GOOD_COMPLETION, "model": "nope"}), 404)
        assert err["code"] == "model_not_found"
        long_prompt = [7] * engine.max_model_len
        err = assert_openai_error(http.post("/v1/completions", json={"prompt": long_prompt}), 400)
        assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
        long_chat = {"messages": [{"role": "user", "content": "word " * engine.max_model_len}]}
        err = assert_openai_error(http.post("/v1/chat/completions", json=long_chat), 400)
        assert err["code"] == "context_length_exceeded" and err["param"] == "messages"
        bad_role = {"messages": [{"role": "wizard", "content": "x"}]}
        err = assert_openai_error(http.post("/v1/chat/completions", json=bad_role), 400)
        assert "messages" in err["param"] and "role" in err["param"]
        err = assert_openai_error(http.post("/v1/completions", content=b"{oops"), 400)
        assert err["code"] == "invalid_json"
        assert_openai_error(http.get("/v1/completions"), 405)
        assert_openai_error(http.get("/v1/nothing-here"), 404)
        r = http.post("/v1/completions", content=b"x" * (2 << 20), headers={"Content-Type": "application/json"})
        assert_openai_error(r, 413)
