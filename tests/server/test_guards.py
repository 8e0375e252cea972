"""Auth, body size, internal failures and the drain, each on a server of its own."""

import threading

import httpx
import openai
import pytest

from tests.server.harness import running_server, wait_until
from tests.server.test_load_and_cancel import engine_idle, sse_events

from .conftest import slow_down

COMPLETION = {"prompt": "The quick", "max_tokens": 3}


def test_api_key_guards_everything_but_health(engine):
    with running_server(engine, api_key="sekret") as srv, httpx.Client(base_url=srv.url) as http:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"},
                        {"Authorization": "Basic sekret"}):
            for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models"), ("GET", "/metrics")):
                r = http.request(method, path, json=COMPLETION, headers=headers)
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert http.get("/health").status_code == 200
        ok = http.post("/v1/completions", json=COMPLETION, headers={"Authorization": "Bearer sekret"})
        assert ok.status_code == 200
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.url + "/v1", api_key="nope", max_retries=0).models.list()
        assert openai.OpenAI(base_url=srv.url + "/v1", api_key="sekret", max_retries=0).models.list().data


def test_body_size_limit_with_and_without_content_length(engine):
    with running_server(engine, max_body_bytes=4096) as srv, httpx.Client(base_url=srv.url) as http:
        big = {"prompt": "x" * 5000, "max_tokens": 1}
        r = http.post("/v1/completions", json=big)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

        def chunks():  # no Content-Length: the limit must hold while the body streams in
            yield b'{"prompt": "'
            for _ in range(10):
                yield b"x" * 1000
            yield b'"}'

        r = http.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
        assert r.status_code == 413
        assert http.post("/v1/completions", json=COMPLETION).status_code == 200


def test_internal_failure_is_a_500_and_the_server_keeps_serving(make_engine):
    engine = make_engine()
    runner = engine._engine.runner
    execute = runner.execute
    with running_server(engine) as srv, httpx.Client(base_url=srv.url, timeout=30) as http:
        runner.execute = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom"))  # the model fails
        r = http.post("/v1/completions", json=COMPLETION)
        assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error"
        with http.stream("POST", "/v1/chat/completions",
                         json={"messages": [{"role": "user", "content": "hi"}], "stream": True}) as r:
            events = sse_events(list(r.iter_lines()))
        assert events[-1] == "[DONE]" and events[-2]["error"]["type"] == "server_error"
        runner.execute = execute
        assert http.post("/v1/completions", json=COMPLETION).status_code == 200
        assert wait_until(lambda: engine_idle(engine))


def test_an_unexpected_exception_is_a_500_with_an_openai_body(make_engine):
    engine = make_engine()
    with running_server(engine) as srv, httpx.Client(base_url=srv.url, timeout=30) as http:
        tokenizer = srv.ctx.tokenizer
        encode = tokenizer.encode

        async def broken(text):
            raise RuntimeError("a bug")

        tokenizer.encode = broken
        r = http.post("/v1/completions", json=COMPLETION)
        assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
        tokenizer.encode = encode
        assert http.post("/v1/completions", json=COMPLETION).status_code == 200


def test_a_failing_step_fails_its_requests_not_the_loop(make_engine):
    engine = make_engine()
    runner = engine._engine.runner
    prepare = runner.prepare
    with running_server(engine) as srv, httpx.Client(base_url=srv.url, timeout=30) as http:
        runner.prepare = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("bad batch"))  # outside LLMEngine's guard
        r = http.post("/v1/completions", json=COMPLETION)
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        runner.prepare = prepare
        assert engine.is_running
        assert http.post("/v1/completions", json=COMPLETION).status_code == 200
        assert wait_until(lambda: engine_idle(engine))


def test_drain_refuses_new_work_and_interrupts_stragglers_at_the_timeout(make_engine):
    engine = make_engine()
    slow_down(engine, 0.01)
    with running_server(engine, drain_timeout=0.5) as srv:
        events: list = []
        started = threading.Event()

        def long_stream() -> None:
            body = {"prompt": "The quick", "max_tokens": 400, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=30) as r:
                for line in r.iter_lines():
                    started.set()
                    events.append(line)

        t = threading.Thread(target=long_stream)
        t.start()
        assert started.wait(10)
        srv.server.begin_drain()
        r = httpx.post(srv.url + "/v1/completions", json=COMPLETION)
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_draining"
        assert httpx.get(srv.url + "/health").status_code == 503
        t.join(10)
        parsed = sse_events(events)
        assert parsed[-1] == "[DONE]" and parsed[-2]["error"]["code"] == "server_shutdown"
        assert wait_until(lambda: engine_idle(engine), timeout=2)
        assert wait_until(lambda: srv.server.should_exit, timeout=5)
