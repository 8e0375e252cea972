"""The repetition guard through the server: settings, request overrides, vLLM's object, stop and retry.

The real-model tests use SmolLM2's own greedy loop ("List 50 fruits." runs into "Honeybees" over and
over); the rest drives a tiny random model, which loops within a few tokens when greedy.
"""

import json

import httpx
import openai
import pytest

from kvyard.engine.repetition import RepetitionDetection
from kvyard.errors import ConfigError
from kvyard.sampling_params import SamplingParams
from kvyard.server.config import ServerSettings, load_deploy_config
from kvyard.server.repetition import RepetitionGuard, request_guard
from tests.server.harness import running_server

LOOPY = {"min_count": 2, "plain_min_tokens": 0, "text_min_count": 0}  # trips the tiny model at once
FRUITS = [{"role": "user", "content": "List 50 fruits."}]


def metric(url: str, name: str) -> float:
    """A sample of /metrics by its full name, labels included; 0 when it was never recorded."""
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.split(" ")[0] == name:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


# ---- settings and their resolution -----------------------------------------------------------------------


def test_deployment_setting_from_yaml(tmp_path):
    path = tmp_path / "deploy.yaml"
    path.write_text("server:\n  repetition_guard:\n    action: retry\n    max_retries: 1\n    min_count: 5\n")
    settings = ServerSettings(**load_deploy_config(path).server)
    assert settings.guard == RepetitionGuard(action="retry", max_retries=1,
                                             detection=RepetitionDetection(min_count=5))
    assert ServerSettings(repetition_guard={"action": False}).guard.action == "off"  # YAML reads `off` as false
    assert ServerSettings().guard.action == "off"


@pytest.mark.parametrize(("value", "param"), [({"action": "explode"}, "repetition_guard.action"),
                                              ({"min_count": 1}, "repetition_guard.min_count"),
                                              ({"max_retries": 9}, "repetition_guard.max_retries"),
                                              ({"min_cuont": 3}, "repetition_guard.min_cuont"),
                                              ("stop", "repetition_guard")])
def test_bad_deployment_settings_are_config_errors(value, param):
    with pytest.raises(ConfigError) as e:
        ServerSettings(repetition_guard=value)
    assert e.value.param == param


def test_request_overrides():
    off, retry = RepetitionGuard(), RepetitionGuard(action="retry")
    assert request_guard(off, None, None) == off
    vllm = request_guard(retry, None, {"max_pattern_size": 8, "min_pattern_size": 0, "min_count": 3})
    assert vllm.action == "stop"  # vLLM's behaviour: the request finishes with "repetition"
    assert vllm.detection == RepetitionDetection.from_vllm(max_pattern_size=8, min_count=3)
    assert request_guard(retry, {"action": "retry"}, {"max_pattern_size": 8, "min_count": 3}).action == "retry"
    assert request_guard(retry, None, {"max_pattern_size": 0}).action == "off"  # vLLM: 0 turns it off
    assert request_guard(off, {"min_count": 6}, None).action == "stop"  # asking for settings asks for it
    assert request_guard(retry, {"min_count": 6}, None) == RepetitionGuard(
        action="retry", detection=RepetitionDetection(min_count=6))


def test_retry_params_new_seed_stronger_penalty():
    guard = RepetitionGuard(action="retry")
    base = SamplingParams(seed=7, repetition_penalty=1.1)
    first, second = guard.retry_params(base, 1), guard.retry_params(base, 2)
    assert first.seed != base.seed and second.seed not in (base.seed, first.seed)
    assert first.repetition_penalty == pytest.approx(1.1 * 1.2) and second.repetition_penalty == pytest.approx(1.1 * 1.44)
    assert guard.retry_params(SamplingParams(), 1).seed is None  # unseeded stays unseeded: a fresh seed


# ---- the tiny model: the wire format, both actions, streams --------------------------------------------


@pytest.fixture(scope="module")
def tiny_server(engine):
    with running_server(engine, repetition_guard={"action": "retry", "max_retries": 2}) as srv:
        yield srv


@pytest.mark.parametrize(("body", "param"), [
    ({"repetition_guard": {"min_count": 1}}, "repetition_guard.min_count"),
    ({"repetition_guard": {"min_cuont": 4}}, "repetition_guard.min_cuont"),
    ({"repetition_guard": {"action": "explode"}}, "repetition_guard.action"),
    ({"repetition_guard": {"max_pattern_size": "4"}}, "repetition_guard.max_pattern_size"),
    ({"repetition_detection": {"max_pattern_size": 4, "min_count": 1}}, "repetition_detection.min_count"),
    ({"repetition_detection": {"max_pattern_size": 4, "min_pattern_size": 5, "min_count": 3}},
     "repetition_detection.min_pattern_size"),
    ({"repetition_detection": {"max_pattern_size": 100, "min_count": 3}}, "repetition_detection.max_pattern_size"),
])
def test_bad_request_settings_are_400_with_param(tiny_server, body, param):
    r = post(tiny_server.url, "/v1/completions", {"prompt": "hi", "max_tokens": 4, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_vllm_object_stops_with_repetition(tiny_server):
    body = {"prompt": "hello hello", "max_tokens": 48, "temperature": 0, "ignore_eos": True,
            "repetition_detection": {"max_pattern_size": 4, "min_count": 2}}
    before = metric(tiny_server.url, 'kvyard_repetition_guard_trips_total{action="stop"}')
    r = post(tiny_server.url, "/v1/completions", body)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "repetition", r.text
    assert r.json()["usage"]["completion_tokens"] < 48
    assert metric(tiny_server.url, 'kvyard_repetition_guard_trips_total{action="stop"}') == before + 1
    # max_pattern_size 0 is vLLM's "off": the deployment's retry guard is off for this request too.
    body["repetition_detection"] = {"max_pattern_size": 0}
    assert post(tiny_server.url, "/v1/completions", body).json()["choices"][0]["finish_reason"] == "length"


def test_retry_until_exhausted_then_repetition(tiny_server):
    # No stronger penalty (1.0) on a greedy request: every attempt loops the same way; 2 retries, then stop.
    retries = 'kvyard_repetition_guard_trips_total{action="retry"}'
    before = metric(tiny_server.url, retries)
    repeated = metric(tiny_server.url, 'kvyard_repetition_guard_retries_total{outcome="repeated"}')
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 48, "temperature": 0,
            "ignore_eos": True, "n": 2, "logprobs": True,
            "repetition_guard": {**LOOPY, "retry_repetition_penalty": 1.0}}
    r = post(tiny_server.url, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["finish_reason"] for c in choices] == ["repetition", "repetition"]
    assert metric(tiny_server.url, retries) == before + 4  # 2 choices x 2 retries
    assert metric(tiny_server.url, 'kvyard_repetition_guard_retries_total{outcome="repeated"}') == repeated + 4
    # Usage counts what the client got: the last attempt's tokens, not the discarded ones.
    assert r.json()["usage"]["completion_tokens"] == sum(len(c["logprobs"]["content"]) for c in choices)


def test_retry_with_a_penalty_recovers(tiny_server):
    recovered = 'kvyard_repetition_guard_retries_total{outcome="recovered"}'
    before = metric(tiny_server.url, recovered)
    body = {"prompt": "hello hello", "max_tokens": 24, "temperature": 0, "ignore_eos": True, "logprobs": 0,
            "repetition_guard": {**LOOPY, "max_retries": 5, "retry_repetition_penalty": 2.0}}
    r = post(tiny_server.url, "/v1/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["logprobs"]["tokens"]) == 24
    assert r.json()["usage"]["completion_tokens"] == 24
    assert metric(tiny_server.url, recovered) == before + 1


def test_a_stream_stops_once_tokens_were_sent(tiny_server):
    retries = 'kvyard_repetition_guard_trips_total{action="retry"}'
    before = metric(tiny_server.url, retries)
    body = {"prompt": "hello hello", "max_tokens": 48, "temperature": 0, "ignore_eos": True, "stream": True,
            "repetition_guard": LOOPY}
    with httpx.stream("POST", tiny_server.url + "/v1/completions", json=body, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    finish = [e["choices"][0]["finish_reason"] for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    assert finish == ["repetition"]
    assert metric(tiny_server.url, retries) == before  # tokens were out before it tripped: no retry


def test_guard_off_by_default(engine):
    with running_server(engine) as srv:
        body = {"prompt": "hello hello", "max_tokens": 32, "temperature": 0, "ignore_eos": True}
        assert post(srv.url, "/v1/completions", body).json()["choices"][0]["finish_reason"] == "length"


# ---- SmolLM2's real greedy loop, through the openai client ----------------------------------------------


def test_smollm2_loop_stop(smollm2_engine):
    with running_server(smollm2_engine, repetition_guard={"action": "stop"}) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        r = client.chat.completions.create(model=smollm2_engine.model_name, messages=FRUITS, max_tokens=120,
                                           temperature=0)
        choice = r.choices[0]
        assert choice.finish_reason == "repetition", choice.message.content
        assert r.usage.completion_tokens < 120
        assert choice.message.content.rstrip().endswith("Honeybees")
        assert metric(srv.url, 'kvyard_repetition_guard_trips_total{action="stop"}') == 1


def test_smollm2_loop_retry(smollm2_engine):
    with running_server(smollm2_engine, repetition_guard={"action": "retry", "max_retries": 1}) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        r = client.chat.completions.create(model=smollm2_engine.model_name, messages=FRUITS, max_tokens=100,
                                           temperature=0)
        assert r.choices[0].finish_reason in ("stop", "length", "repetition")
        assert r.usage.completion_tokens <= 100
        assert metric(srv.url, 'kvyard_repetition_guard_trips_total{action="retry"}') == 1
        assert metric(srv.url, 'kvyard_repetition_guard_retries_total{outcome="recovered"}') + metric(
            srv.url, 'kvyard_repetition_guard_retries_total{outcome="repeated"}') == 1


def test_smollm2_legitimate_repetition_passes(smollm2_engine):
    # Counting, a markdown table and indented code, greedy, with the guard on: none of it is a loop.
    asks = ["Count from 1 to 25, one number per line.", "Make a markdown table of 5 countries and their capitals.",
            "Write a Python class for a bank account with deposit and withdraw methods."]
    tok = smollm2_engine.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": a}], add_generation_prompt=True, tokenize=True,
                                       return_dict=False) for a in asks]
    with running_server(smollm2_engine, repetition_guard={"action": "stop"}) as srv:
        r = post(srv.url, "/v1/completions", {"prompt": prompts, "max_tokens": 120, "temperature": 0})
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
        assert len(choices) == 3 and all(
            c["finish_reason"] in ("stop", "length") for c in choices), choices
        assert "15. 15" in choices[0]["text"] and "| --- |" in choices[1]["text"]
        assert "        self.balance" in choices[2]["text"]
        assert metric(srv.url, 'kvyard_repetition_guard_trips_total{action="stop"}') == 0
