"""Concurrency, cancellation, admission control and deadlines, checked against the engine's own counters."""

import asyncio
import json
import socket

import httpx

from tests.server.conftest import slow_down
from tests.server.harness import running_server, wait_until


def engine_idle(engine) -> bool:
    s = engine.stats()
    return (s.num_running == 0 and s.num_waiting == 0 and s.num_open_requests == 0
            and s.num_free_blocks == s.num_total_blocks)


def queued_in_engine(engine) -> int:
    s = engine.stats()
    return s.num_running + s.num_waiting


def sse_events(lines: list[str]) -> list[dict | str]:
    return [json.loads(line[6:]) if line != "data: [DONE]" else "[DONE]" for line in lines if line.startswith("data: ")]


async def stream_completion(http: httpx.AsyncClient, prompt: str, max_tokens: int) -> tuple[str, dict, int]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    async with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = [line async for line in r.aiter_lines()]
    events = sse_events(lines)
    assert events[-1] == "[DONE]"
    text = "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])
    finish = [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"] and e["choices"][0]["finish_reason"]]
    assert finish == ["length"]
    return text, events[-2]["usage"], len(events)


def test_64_concurrent_streams_complete_with_exact_token_counts(engine):
    prompts = ["The quick brown fox", "def add(a, b):", "Paged attention keeps", "Zwölf Boxkämpfer"]

    async def main(url: str) -> list[tuple[str, dict, int]]:
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as http:
            return await asyncio.gather(*(stream_completion(http, prompts[i % 4], 24) for i in range(64)))

    with running_server(engine) as srv:
        results = asyncio.run(main(srv.url))
    assert len(results) == 64
    for _, usage, _ in results:
        assert usage["completion_tokens"] == 24
    for i in range(4):  # greedy: every copy of a prompt produced the same text
        assert len({results[j][0] for j in range(i, 64, 4)}) == 1
    assert wait_until(lambda: engine_idle(engine))


def test_disconnect_mid_stream_frees_blocks_at_once(make_engine):
    engine = make_engine()
    slow_down(engine, 0.01)  # 400 tokens take ~4 s: the stream is surely still running when we leave
    with running_server(engine) as srv:
        body = {"prompt": "The quick", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=srv.url, timeout=30) as http, http.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            for _ in range(3):
                next(lines)
            assert engine.stats().num_running == 1 and engine.stats().num_free_blocks < engine.stats().num_total_blocks
        # Leaving the block closed the connection.
        assert wait_until(lambda: engine_idle(engine), timeout=2)
        metrics = httpx.get(srv.url + "/metrics").text
        assert 'kvyard_requests_total{outcome="cancelled"} 1.0' in metrics
        assert engine.stats().generation_tokens < 400


def test_disconnect_while_waiting_for_a_non_streamed_result_aborts(make_engine):
    engine = make_engine()
    slow_down(engine, 0.01)
    with running_server(engine) as srv:
        with httpx.Client(base_url=srv.url, timeout=0.5) as http:
            try:
                http.post("/v1/completions", json={"prompt": "The quick", "max_tokens": 400, "ignore_eos": True})
                raise AssertionError("the request should not finish in 0.5 s")
            except httpx.ReadTimeout:
                pass  # the client gave up and closed the connection
        assert wait_until(lambda: engine_idle(engine), timeout=2)
        assert engine.stats().generation_tokens < 400


def test_full_queue_returns_429_with_retry_after(make_engine):
    engine = make_engine(max_num_seqs=1)  # one runs, the rest wait
    slow_down(engine, 0.01)
    with running_server(engine, max_queue=2) as srv:
        async def main() -> list[int]:
            async with httpx.AsyncClient(base_url=srv.url, timeout=30) as http:
                body = {"prompt": "The quick", "max_tokens": 300, "ignore_eos": True}
                # One at a time: each must be in the engine before the next is admitted against max_queue.
                slow = []
                for i in range(1, 4):
                    slow.append(asyncio.create_task(http.post("/v1/completions", json=body)))
                    assert await asyncio.to_thread(wait_until, lambda n=i: queued_in_engine(engine) == n)
                assert engine.stats().num_waiting == 2
                flood = await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(10)))
                for r in flood:
                    assert r.status_code == 429 and r.headers["Retry-After"] == "1"
                    assert r.json()["error"]["code"] == "rate_limit_exceeded"
                for t in slow:
                    t.cancel()
                await asyncio.gather(*slow, return_exceptions=True)
                return [r.status_code for r in flood]

        assert asyncio.run(main()) == [429] * 10
        assert wait_until(lambda: engine_idle(engine), timeout=5)
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200


def test_deadline_ends_requests_and_frees_blocks(make_engine):
    engine = make_engine()
    slow_down(engine, 0.01)
    with running_server(engine, request_timeout=0.3) as srv, httpx.Client(base_url=srv.url, timeout=30) as http:
        body = {"prompt": "The quick", "max_tokens": 400, "ignore_eos": True}
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 504 and r.json()["error"]["code"] == "request_timeout"
        assert wait_until(lambda: engine_idle(engine), timeout=2)
        with http.stream("POST", "/v1/chat/completions",
                         json={"messages": [{"role": "user", "content": "hi"}], **body, "stream": True}) as r:
            assert r.status_code == 200
            events = sse_events(list(r.iter_lines()))
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "request_timeout"
        assert wait_until(lambda: engine_idle(engine), timeout=2)
        assert 'kvyard_requests_total{outcome="timeout"} 2.0' in http.get("/metrics").text


def test_raw_socket_hangup_before_response(make_engine):
    """A client that sends a request and vanishes at once leaves nothing behind. 5 x 200 tokens at >= 20 ms a
    step would take 4 s or more: only aborting them makes the engine idle within 3 s."""
    engine = make_engine()
    slow_down(engine, 0.02)
    with running_server(engine) as srv:
        host, port = srv.url.removeprefix("http://").split(":")
        body = json.dumps({"prompt": "The quick", "max_tokens": 200, "ignore_eos": True, "stream": True}).encode()
        for _ in range(5):
            with socket.create_connection((host, int(port))) as s:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        # Idle at once would prove nothing (the requests may not have arrived yet): wait for the 5 aborts.
        assert wait_until(lambda: engine.stats().num_aborted == 5, timeout=3), engine.stats()
        assert wait_until(lambda: engine_idle(engine), timeout=3)
    assert engine.stats().generation_tokens < 500, engine.stats()
