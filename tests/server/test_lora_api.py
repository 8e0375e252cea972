"""LoRA adapters over HTTP: a request's `model` names one, /v1/models lists them with their parent, and (behind a
flag) adapters load and unload at run time; a bad adapter is a 400 naming the file, and serving goes on."""

import httpx
import openai
import pytest

from kvyard import LLM, SamplingParams
from kvyard.server.repetition import RepetitionGuard, request_guard
from tests.lora.adapters import make_adapter
from tests.server.harness import running_server

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def adapters(tiny_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("served-adapters")
    return {name: make_adapter(tiny_path, root / name, seed=i) for i, name in enumerate(("plain", "second"))}


def _complete(client: openai.OpenAI, model: str) -> str:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0.0,
                                    extra_body={"ignore_eos": True})
    assert out.model == model
    return out.choices[0].text


def test_adapters_are_models_and_load_at_run_time(make_engine, tiny_path, adapters):
    engine = make_engine(lora_adapters={"plain": str(adapters["plain"])})
    offline = LLM(str(tiny_path), dtype="float32", lora_adapters={n: str(p) for n, p in adapters.items()})
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    want = {name: offline.generate([PROMPT], greedy, lora=name)[0].outputs[0].text for name in adapters}
    with running_server(engine, enable_lora_runtime_updates=True) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30)
        cards = {m.id: m for m in client.models.list().data}
        base = server.ctx.model_name
        assert set(cards) == {base, "plain"}
        assert cards["plain"].parent == base and cards["plain"].root == str(adapters["plain"])
        base_text = _complete(client, base)
        assert _complete(client, "plain") == want["plain"] != base_text
        with pytest.raises(openai.NotFoundError, match="LoRA adapters plain"):
            _complete(client, "second")

        load = httpx.post(server.url + "/v1/load_lora_adapter",
                          json={"lora_name": "second", "lora_path": str(adapters["second"])}, timeout=30)
        assert load.status_code == 200, load.text
        assert _complete(client, "second") == want["second"]
        bad = httpx.post(server.url + "/v1/load_lora_adapter",
                         json={"lora_name": "broken", "lora_path": str(tiny_path)}, timeout=30)
        assert bad.status_code == 400 and "adapter_config.json: missing" in bad.json()["error"]["message"]
        assert str(tiny_path) in bad.json()["error"]["message"]
        assert _complete(client, "plain") == want["plain"]  # serving goes on

        assert httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "second"}, timeout=30
                          ).status_code == 200
        assert {m.id for m in client.models.list().data} == {base, "plain"}
        with pytest.raises(openai.NotFoundError):
            _complete(client, "second")
        gone = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "second"}, timeout=30)
        assert gone.status_code == 400 and "unknown LoRA adapter 'second'" in gone.json()["error"]["message"]
        assert _complete(client, base) == base_text


def test_runtime_updates_are_off_unless_enabled(engine, adapters):
    with running_server(engine) as server:
        r = httpx.post(server.url + "/v1/load_lora_adapter",
                       json={"lora_name": "plain", "lora_path": str(adapters["plain"])}, timeout=30)
        assert r.status_code == 404 and "--enable-lora-runtime-updates" in r.json()["error"]["message"]


def test_a_repetition_retry_runs_with_the_requests_adapter(make_engine, tiny_path, adapters):
    """The guard's retry is a new engine request: it must carry the adapter too (the tiny model loops at once)."""
    loopy = {"action": "retry", "min_count": 2, "plain_min_tokens": 0, "text_min_count": 0, "max_retries": 1,
             "retry_repetition_penalty": 2.0}
    body = {"model": "plain", "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
            "repetition_guard": loopy}
    offline = LLM(str(tiny_path), dtype="float32", lora_adapters={"plain": str(adapters["plain"])})
    guard = request_guard(RepetitionGuard(), loopy, None)
    first = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                           repetition_detection=guard.detection)
    assert offline.generate([PROMPT], first, lora="plain")[0].outputs[0].finish_reason == "repetition"
    retried = offline.generate([PROMPT], guard.retry_params(first, 1), lora="plain")[0].outputs[0]
    base_retried = offline.generate([PROMPT], guard.retry_params(first, 1))[0].outputs[0]
    assert retried.text != base_retried.text
    with running_server(make_engine(lora_adapters={"plain": str(adapters["plain"])})) as server:
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (retried.text, retried.finish_reason)


def test_unloading_a_busy_adapter_is_a_409_until_its_requests_end(make_engine, adapters):
    import threading

    from tests.server.conftest import slow_down
    from tests.server.harness import wait_until

    engine = make_engine(lora_adapters={"plain": str(adapters["plain"])})
    slow_down(engine, 0.05)  # a 40-token request runs about 2 s
    with running_server(engine, enable_lora_runtime_updates=True) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
        done = threading.Event()
        threading.Thread(target=lambda: (client.completions.create(
            model="plain", prompt=PROMPT, max_tokens=40, extra_body={"ignore_eos": True}), done.set()),
            daemon=True).start()
        assert wait_until(lambda: engine.stats().num_running >= 1, timeout=20)
        busy = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "plain"}, timeout=30)
        assert busy.status_code == 409 and busy.json()["error"]["code"] == "adapter_busy"
        assert done.wait(30)
        assert httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "plain"}, timeout=30
                          ).status_code == 200
