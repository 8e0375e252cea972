"""API fidelity, round two, through the official openai client against a real server on loopback:
logit_bias, echo, prompt_logprobs, /tokenize and /detokenize, the model's generation defaults, and the
repetition guard that deployments turn on. Sampling runs at temperature 1 where it matters."""

import json
import shutil

import openai
import pytest
import torch

from kvyard.cli.main import build_parser
from kvyard.cli.serve import configs_from_args
from kvyard.engine.repetition import RepetitionDetection
from kvyard.server.repetition import RepetitionGuard
from tests.conftest import hf_reference
from tests.server.conftest import tiny_engine_config
from tests.server.harness import running_server

SAMPLED = {"temperature": 1.0, "extra_body": {"ignore_eos": True}}
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}
PROMPT = "The quick brown fox jumps over the lazy dog."
FOX, DOG, THE = 291, 290, 275  # single tokens of the tiny tokenizer: " fox", " dog", " the"


def clients(url: str) -> tuple[openai.OpenAI, openai.OpenAI]:
    """One for /v1, one for vLLM's /tokenize and /detokenize, which sit at the root."""
    return (openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60),
            openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60))


@pytest.fixture(scope="module")
def server(engine):
    with running_server(engine, served_model_name="tiny") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return clients(server.url)[0]


@pytest.fixture(scope="module")
def root(server):
    return clients(server.url)[1]


@pytest.fixture(scope="module")
def oracle(tiny_path, engine):
    """HF's log_softmax over PROMPT's positions (row p scores token p + 1)."""
    ids = engine.tokenizer(PROMPT, add_special_tokens=True).input_ids
    with torch.no_grad():
        return ids, hf_reference(tiny_path)(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def bad_request(call, param: str) -> dict:
    with pytest.raises(openai.BadRequestError) as e:
        call()
    error = e.value.body if "message" in e.value.body else e.value.body["error"]
    assert e.value.status_code == 400 and error["param"].startswith(param), error
    return error


# ---- logit_bias -----------------------------------------------------------------------------------------


def test_logit_bias_forces_and_bans(client, engine):
    forced = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, n=3, logit_bias={str(FOX): 100},
                                       presence_penalty=2.0, frequency_penalty=2.0, **SAMPLED)
    assert [c.text for c in forced.choices] == [" fox" * 6] * 3  # the bias outweighs both penalties
    allowed = {FOX, DOG, THE}
    bans = {str(t): -100 for t in range(engine.model_config.vocab_size) if t not in allowed}
    banned = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, n=4, logprobs=0,
                                       logit_bias=bans, **SAMPLED)
    assert all(set(c.logprobs.tokens) <= {" fox", " dog", " the"} for c in banned.choices)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                          logit_bias={str(DOG): 100}, **SAMPLED)
    assert chat.choices[0].message.content == " dog" * 5


def test_bad_logit_bias_is_a_400(client, engine):
    vocab = engine.model_config.vocab_size
    for bias in ({str(vocab): 1}, {"abc": 1}, {"-3": 1}, {"5": 150}, {"5": -100.5}, {"5": True}):
        bad_request(lambda b=bias: client.completions.create(model="tiny", prompt="x", max_tokens=1, logit_bias=b),
                    "logit_bias")
    error = bad_request(lambda: client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=1, logit_bias={str(vocab + 7): 5}),
        "logit_bias")
    assert str(vocab + 7) in error["message"]


def test_a_grammar_still_wins(client):
    # The bias comes before the grammar's mask: a forbidden token stays forbidden, an allowed one is pushed.
    choice = {"guided_choice": ["yes", "no"], "ignore_eos": True}
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, n=4, temperature=1.0,
                                  logit_bias={str(FOX): 100}, extra_body=choice)
    assert all(c.text in ("yes", "no") for c in r.choices)
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, n=4, temperature=1.0,
                                  logit_bias={"80": 100}, extra_body=choice)  # 80: "n"
    assert [c.text for c in r.choices] == ["no"] * 4


def test_speculative_decoding_keeps_the_bias(make_engine, client):
    body = {"model": "tiny", "prompt": PROMPT + " The quick brown fox", "max_tokens": 12, "logit_bias": {str(FOX): -100,
            str(THE): 3}, **GREEDY}
    plain = client.completions.create(**body).choices[0].text
    spec = make_engine(speculative_method="ngram")
    with running_server(spec, served_model_name="tiny") as srv:
        assert clients(srv.url)[0].completions.create(**body).choices[0].text == plain
    assert spec.stats().spec_proposed_tokens > 0 and " fox" not in plain


# ---- echo and prompt_logprobs ----------------------------------------------------------------------------


def test_echo_returns_the_prompt_and_its_logprobs(client, oracle):
    ids, logprobs = oracle
    # Greedy: three unseeded samples of a random model can all be special tokens or half characters, no text
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, echo=True, logprobs=2, **GREEDY)
    c = r.choices[0]
    assert c.text.startswith(PROMPT) and len(c.text) > len(PROMPT)
    lp = c.logprobs
    assert len(lp.tokens) == len(ids) + 3
    # The prompt's tokens spell the prompt; the generated ones are not compared as text (the last can be half a
    # character, U+FFFD in the logprobs and left out of the text).
    assert "".join(lp.tokens[: len(ids)]) == PROMPT
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
    for p in range(1, len(ids)):
        assert lp.token_logprobs[p] == pytest.approx(float(logprobs[p - 1, ids[p]]), abs=1e-4)
        assert len(lp.top_logprobs[p]) == 2 and max(lp.top_logprobs[p].values()) == pytest.approx(
            float(logprobs[p - 1].max()), abs=1e-4)
    assert lp.text_offset[len(ids)] == len(PROMPT) and lp.text_offset[:2] == [0, len(lp.tokens[0])]


def test_echo_with_token_prompts_batches_and_streams(client, engine):
    ids = engine.tokenizer("def add(a, b):", add_special_tokens=True).input_ids
    r = client.completions.create(model="tiny", prompt=[ids, ids[:3]], max_tokens=2, n=2, echo=True, **SAMPLED)
    texts = [engine.tokenizer.decode(ids), engine.tokenizer.decode(ids[:3])]
    assert [c.text[: len(texts[c.index // 2])] for c in r.choices] == [texts[0], texts[0], texts[1], texts[1]]
    full = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, echo=True, **GREEDY).choices[0]
    chunks = [c for c in client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, echo=True, stream=True,
                                                    logprobs=1, **GREEDY) if c.choices]
    assert chunks[0].choices[0].text.startswith(PROMPT) and chunks[0].choices[0].logprobs.token_logprobs[0] is None
    assert "".join(c.choices[0].text for c in chunks) == full.text


def test_prompt_logprobs(client, oracle):
    ids, logprobs = oracle
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, extra_body={"prompt_logprobs": 3},
                                  temperature=1.0)
    scored = r.choices[0].prompt_logprobs  # vLLM's field: the client keeps it as an extra
    assert len(scored) == len(ids) and scored[0] is None
    for p, entry in enumerate(scored[1:], start=1):
        own = entry[str(ids[p])]
        assert own["logprob"] == pytest.approx(float(logprobs[p - 1, ids[p]]), abs=1e-4)
        assert own["rank"] == int((logprobs[p - 1] > logprobs[p - 1, ids[p]]).sum()) + 1
        top = logprobs[p - 1].topk(3).indices.tolist()
        assert set(entry) == {str(t) for t in top} | {str(ids[p])} and entry[str(top[0])]["rank"] == 1
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                          extra_body={"prompt_logprobs": 0})
    assert len(chat.prompt_logprobs) == chat.usage.prompt_tokens and all(len(e) == 1 for e in chat.prompt_logprobs[1:])
    bad_request(lambda: client.completions.create(model="tiny", prompt="x", max_tokens=2, stream=True,
                                                  extra_body={"prompt_logprobs": 1}), "prompt_logprobs")
    bad_request(lambda: client.completions.create(model="tiny", prompt="x", max_tokens=2,
                                                  extra_body={"prompt_logprobs": 21}), "prompt_logprobs")


# ---- /tokenize and /detokenize ----------------------------------------------------------------------------


def test_tokenize_and_detokenize(client, root, engine):
    ids = engine.tokenizer(PROMPT, add_special_tokens=True).input_ids
    r = root.post("/tokenize", body={"model": "tiny", "prompt": PROMPT, "return_token_strs": True}, cast_to=object)
    assert r == {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,
                 "token_strs": engine.tokenizer.convert_ids_to_tokens(ids)}
    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1)
    r = root.post("/tokenize", body={"messages": messages}, cast_to=object)
    assert r["count"] == chat.usage.prompt_tokens and r["token_strs"] is None
    bare = root.post("/tokenize", body={"messages": messages, "add_generation_prompt": False}, cast_to=object)
    assert bare["count"] < r["count"]
    assert root.post("/detokenize", body={"tokens": ids}, cast_to=object) == {"prompt": PROMPT}
    bad_request(lambda: root.post("/detokenize", body={"tokens": [engine.model_config.vocab_size]}, cast_to=object),
                "tokens")
    bad_request(lambda: root.post("/tokenize", body={"prompt": "x", "messages": messages}, cast_to=object), "prompt")
    with pytest.raises(openai.NotFoundError):
        root.post("/tokenize", body={"model": "other", "prompt": "x"}, cast_to=object)


# ---- generation defaults ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def defaults_engine(tiny_path, tmp_path_factory):
    from kvyard.server.async_engine import AsyncEngine

    path = tmp_path_factory.mktemp("defaults") / "m"
    shutil.copytree(tiny_path, path)
    config = json.loads((path / "generation_config.json").read_text())
    config.update(temperature=0.0, repetition_penalty=1.5, max_new_tokens=5, top_k=-5)  # top_k -5: dropped
    (path / "generation_config.json").write_text(json.dumps(config))
    eng = AsyncEngine.from_config(tiny_engine_config(path))
    yield eng
    eng.shutdown()


def test_the_models_defaults_apply_where_a_request_is_silent(defaults_engine):
    with running_server(defaults_engine, served_model_name="tiny") as srv:
        client = clients(srv.url)[0]
        assert client.models.list().data[0].generation_defaults == {
            "temperature": 0.0, "repetition_penalty": 1.5, "max_tokens": 5}
        assert client.models.list().data[0].batch_invariant is False  # an fp32 engine: the bf16 path is off
        silent = client.completions.create(model="tiny", prompt=PROMPT, extra_body={"ignore_eos": True})
        explicit = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0.0,
                                             extra_body={"ignore_eos": True, "repetition_penalty": 1.5})
        assert silent.usage.completion_tokens == 5 and silent.choices[0].text == explicit.choices[0].text
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                              extra_body={"ignore_eos": True})
        assert chat.usage.completion_tokens == 5
        # A request's own values win: sampled (seeds differ), longer.
        mine = {client.completions.create(model="tiny", prompt=PROMPT, max_tokens=7, seed=s, **SAMPLED).choices[0].text
                for s in range(4)}
        assert len(mine) > 1
    with running_server(defaults_engine, served_model_name="tiny", generation_config="none") as srv:
        client = clients(srv.url)[0]
        assert client.models.list().data[0].generation_defaults == {}
        assert client.completions.create(model="tiny", prompt=PROMPT, extra_body={"ignore_eos": True}
                                         ).usage.completion_tokens == 16


# ---- the repetition guard of a deployment -----------------------------------------------------------------


def serve_configs(*argv: str):
    return configs_from_args(build_parser().parse_args(["serve", *argv]))[1]


def test_deployments_guard_by_default_and_can_switch_it_off(tmp_path, monkeypatch):
    monkeypatch.delenv("KVYARD_API_KEY", raising=False)
    assert serve_configs().guard == RepetitionGuard(action="stop")  # `make serve`
    path = tmp_path / "deploy.yaml"
    path.write_text("server:\n  repetition_guard:\n    min_count: 5\n")
    assert serve_configs("--config", str(path)).guard == RepetitionGuard(
        action="stop", detection=RepetitionDetection(min_count=5))
    off = serve_configs("--config", str(path), "--repetition-guard", "off").guard
    assert off.action == "off" and off.detection.min_count == 5
    path.write_text("server:\n  repetition_guard:\n    action: off\n")  # YAML reads it as false
    assert serve_configs("--config", str(path)).guard.action == "off"
    assert serve_configs("--repetition-guard", "retry").guard.action == "retry"


def test_a_request_switches_the_guard_off(engine):
    loopy = {"action": "stop", "min_count": 2, "plain_min_tokens": 0, "text_min_count": 0}
    with running_server(engine, served_model_name="tiny", repetition_guard=loopy) as srv:
        client = clients(srv.url)[0]

        def finish(**extra) -> str:
            return client.completions.create(model="tiny", prompt="hello hello", max_tokens=32, temperature=0.0,
                                             extra_body={"ignore_eos": True, **extra}).choices[0].finish_reason

        assert finish() == "repetition"
        assert finish(repetition_guard={"action": "off"}) == "length"
        assert finish(repetition_detection={"max_pattern_size": 0}) == "length"  # vLLM's way to say off
