"""The official openai client against a real server on loopback: the wire format is what it expects."""

import copy

import httpx
import openai
import pytest

from tests.server.harness import running_server

GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def server(engine):
    with running_server(engine, served_model_name="tiny") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def test_models_lists_the_served_model(client, engine):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]
    assert models[0].max_model_len == engine.max_model_len


def test_completion_with_usage_and_logprobs(client):
    r = client.completions.create(model="tiny", prompt="The quick brown", max_tokens=7, logprobs=3, **GREEDY)
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == "tiny"
    choice = r.choices[0]
    assert choice.finish_reason == "length"
    assert r.usage.completion_tokens == 7 and r.usage.total_tokens == r.usage.prompt_tokens + 7
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 7
    assert all(len(top) <= 3 for top in lp.top_logprobs) and all(v <= 0 for v in lp.token_logprobs)


def test_token_and_batched_prompts(client, engine):
    ids = engine.tokenizer("The quick brown", add_special_tokens=True).input_ids
    by_text = client.completions.create(model="tiny", prompt="The quick brown", max_tokens=6, **GREEDY)
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=6, **GREEDY)
    assert by_ids.choices[0].text == by_text.choices[0].text
    batch = client.completions.create(model="tiny", prompt=["The quick brown", "def add"], max_tokens=6, n=2,
                                      **GREEDY)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == by_text.choices[0].text  # greedy: both copies of prompt 0 agree
    assert batch.usage.completion_tokens == 24


def test_streamed_completion_adds_up(client):
    full = client.completions.create(model="tiny", prompt="Paged attention", max_tokens=10, **GREEDY)
    chunks = list(client.completions.create(model="tiny", prompt="Paged attention", max_tokens=10, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_chat_non_streaming_and_streaming(client):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Say hi"}]}]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, **GREEDY)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 8
    stream = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=8, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 8 and chunks[-1].object == "chat.completion.chunk"


def test_chat_n_and_logprobs(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                       n=3, seed=11, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.message.content for c in r.choices}) > 1  # seeds seed+i: the samples differ
    assert r.usage.completion_tokens == 18
    for c in r.choices:
        assert len(c.logprobs.content) == 6 and all(len(t.top_logprobs) == 2 for t in c.logprobs.content)


def test_chat_streaming_n_interleaves_choices(client):
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=5, n=2, stream=True, **GREEDY))
    finished = sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason)
    assert finished == [0, 1]


def test_stop_string_truncates(client):
    full = client.completions.create(model="tiny", prompt="The quick", max_tokens=12, **GREEDY).choices[0].text
    stop = next(full[i : i + 3] for i in range(2, len(full) - 3) if "\ufffd" not in full[i : i + 3])
    r = client.completions.create(model="tiny", prompt="The quick", max_tokens=12, stop=[stop], **GREEDY)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == full[: full.index(stop)]


def test_seed_reproducibility(client):
    def sample(seed: int) -> str:
        return client.completions.create(model="tiny", prompt="The quick", max_tokens=12, temperature=1.0,
                                          seed=seed, extra_body={"ignore_eos": True}).choices[0].text

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_tools_and_tool_messages_reach_the_template(client, engine):
    messages = [
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    r = client.chat.completions.create(model="tiny", messages=messages, tools=tools, max_tokens=3, **GREEDY)
    assert r.choices[0].finish_reason == "length"
    # This template ignores `tools` and `tool_calls`, so kvyard writes them into the prompt itself
    # (kvyard/server/tools.py). Each part of the request must reach the prompt: growing it grows the prompt.
    def prompt_tokens(**changes) -> int:
        history = copy.deepcopy(messages)
        history[1]["tool_calls"][0]["function"]["arguments"] = changes.get("arguments", "{}")
        history[2]["content"] = changes.get("answer", "sunny")
        reply = client.chat.completions.create(model="tiny", messages=history, tools=changes.get("tools", tools),
                                               max_tokens=1, **GREEDY)
        return reply.usage.prompt_tokens

    base = prompt_tokens()
    assert base == r.usage.prompt_tokens
    described = [{"type": "function", "function": {**tools[0]["function"], "description": "Current weather."}}]
    assert prompt_tokens(tools=described) > base  # the tool's schema
    assert prompt_tokens(arguments='{"city": "Paris", "unit": "celsius"}') > base  # the assistant's call
    assert prompt_tokens(answer="sunny, 24 degrees, light wind from the west") > base  # the tool's answer


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"


def test_health_and_metrics(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    text = httpx.get(server.url + "/metrics").text
    for name in ("kvyard_requests_total", "kvyard_time_to_first_token_seconds_bucket",
                 "kvyard_inter_token_latency_seconds_bucket", "kvyard_e2e_request_latency_seconds_bucket",
                 "kvyard_prompt_tokens_total", "kvyard_generation_tokens_total", "kvyard_num_requests_running",
                 "kvyard_num_requests_waiting", "kvyard_kv_cache_usage_ratio", "kvyard_num_preemptions_total",
                 "kvyard_prefix_cache_queries_total", "kvyard_prefix_cache_hits_total", "kvyard_prefix_cache_blocks",
                 "kvyard_repetition_guard_trips_total"):
        assert name in text, name
    assert 'kvyard_requests_total{outcome="length"}' in text


def test_prefix_cache_hits_show_in_metrics(server, client):
    def hits() -> float:
        for line in httpx.get(server.url + "/metrics").text.splitlines():
            if line.startswith("kvyard_prefix_cache_hits_total "):
                return float(line.split()[1])
        raise AssertionError("no prefix-cache hit counter")

    prompt = "Paged attention keeps the KV cache in fixed-size blocks. " * 4
    before = hits()
    for _ in range(2):
        client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    assert hits() > before
