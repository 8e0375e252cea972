"""Offering a workload to a server: closed loop at a concurrency, or open loop at a Poisson rate.

Closed loop: N workers, each sends its next session as soon as the previous one finished, so N
sessions are always in flight (throughput at a given load). Open loop: sessions arrive at exponential
intervals whatever the server does (latency at a given offered rate; queues grow if it is too slow).
The turns of a session go one after the other, each carrying the history so far. Every request has a
timeout, and the number of sessions is fixed, so a run always ends.
"""

import asyncio
import math
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from kvyard.bench.serve_client import RequestResult, stream_request
from kvyard.bench.serve_workloads import Session, Turn


@dataclass
class LoadSpec:
    mode: Literal["closed", "poisson", "trace"] = "closed"
    concurrency: int = 8  # closed loop: sessions in flight
    rate: float = math.inf  # poisson: sessions per second; inf sends them all at once
    seed: int = 0
    time_scale: float = 1.0  # trace: each session at its recorded offset times this (0.5: twice as fast)

    def describe(self) -> dict[str, Any]:
        if self.mode == "trace":
            return {"mode": "trace", "time_scale": self.time_scale}
        if self.mode == "closed":
            return {"mode": "closed", "concurrency": self.concurrency}
        return {"mode": "poisson", "request_rate": None if math.isinf(self.rate) else self.rate, "seed": self.seed}


@dataclass
class RequestOptions:
    model: str
    temperature: float = 0.0
    # max_tokens with ignore_eos (vLLM, kvyard) and min_tokens (llama-cpp-python masks EOS until then)
    # make every server produce exactly the requested number of tokens.
    ignore_eos: bool = True
    timeout: float = 300.0
    extra_body: dict[str, Any] = field(default_factory=dict)


def request_body(session: Session, turn: Turn, history: list[dict[str, str]], opts: RequestOptions
                 ) -> tuple[str, dict[str, Any]]:
    """The path and JSON body of one turn."""
    body: dict[str, Any] = {
        "model": opts.model, "max_tokens": turn.max_tokens, "temperature": opts.temperature,
        "stream": True, "stream_options": {"include_usage": True},
    }
    if opts.ignore_eos:
        body |= {"ignore_eos": True, "min_tokens": turn.max_tokens}
    if session.endpoint == "completions":
        body["prompt"] = turn.content
        path = "/v1/completions"
    else:
        system = [{"role": "system", "content": session.system}] if session.system else []
        body["messages"] = system + history + [{"role": "user", "content": turn.content}]
        if session.tools:
            body["tools"] = session.tools
        path = "/v1/chat/completions"
    return path, body | opts.extra_body


async def run_session(client: httpx.AsyncClient, session: Session, opts: RequestOptions, run_start: float,
                      on_result: Callable[[RequestResult], None]) -> list[RequestResult]:
    history: list[dict[str, str]] = []
    results: list[RequestResult] = []
    for i, turn in enumerate(session.turns):
        path, body = request_body(session, turn, history, opts)
        res = await stream_request(client, path, body, opts.timeout, run_start, turn.max_tokens)
        results.append(res)
        on_result(res)
        if not res.ok:
            # The rest of the conversation depends on this reply: count its turns as failed, unsent.
            for rest in session.turns[i + 1 :]:
                skipped = RequestResult(ok=False, start=res.start, expected_output_tokens=rest.max_tokens,
                                        error="not sent: an earlier turn of its conversation failed")
                results.append(skipped)
                on_result(skipped)
            break
        history += [{"role": "user", "content": turn.content}, {"role": "assistant", "content": res.text}]
    return results


async def offer_load(client: httpx.AsyncClient, sessions: list[Session], load: LoadSpec, opts: RequestOptions,
                     on_result: Callable[[RequestResult], None]) -> tuple[list[RequestResult], float]:
    """Run every session under `load`; returns the results and the run's duration in seconds."""
    run_start = time.perf_counter()
    if load.mode == "closed":
        pending = deque(sessions)
        done: list[RequestResult] = []

        async def worker() -> None:
            while pending:
                done.extend(await run_session(client, pending.popleft(), opts, run_start, on_result))

        await asyncio.gather(*(worker() for _ in range(min(load.concurrency, len(sessions)))))
        results = done
    elif load.mode == "trace":  # open loop at the recorded arrival times
        tasks = []
        for session in sessions:
            await asyncio.sleep(max(0.0, run_start + (session.at_s or 0.0) * load.time_scale - time.perf_counter()))
            tasks.append(asyncio.create_task(run_session(client, session, opts, run_start, on_result)))
        results = [r for rs in await asyncio.gather(*tasks) for r in rs]
    else:
        rng = random.Random(load.seed)
        tasks = []
        for i, session in enumerate(sessions):
            if i and not math.isinf(load.rate):
                await asyncio.sleep(rng.expovariate(load.rate))
            tasks.append(asyncio.create_task(run_session(client, session, opts, run_start, on_result)))
        results = [r for rs in await asyncio.gather(*tasks) for r in rs]
    duration = time.perf_counter() - run_start
    results.sort(key=lambda r: r.start)
    return results, duration
