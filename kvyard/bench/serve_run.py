"""One serving benchmark: a workload offered to a server under one or more loads, summarized.

`run_benchmark` is what `kvyard bench serve` and `kvyard bench serve-compare` call; it returns the
JSON-ready report. A sweep is several closed-loop runs, one per concurrency, each with fresh prompts (the
workload's seed plus the load's index; the warm-up's seed is one less), so no level finds the prompts of
another in a prefix cache.
"""

import asyncio
import ipaddress
import platform
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any
from urllib.parse import urlsplit

import httpx
from tqdm import tqdm

from kvyard.bench.serve_client import RequestResult
from kvyard.bench.serve_load import LoadSpec, RequestOptions, offer_load, run_session
from kvyard.bench.serve_metrics import SLOs, request_records, summarize
from kvyard.bench.serve_workloads import Session, Turn, WorkloadSpec, build_sessions, load_tokenizer
from kvyard.bench.trace import TraceError, read_trace


@dataclass
class ServeBenchConfig:
    url: str
    workload: WorkloadSpec
    loads: list[LoadSpec]
    model: str | None = None  # None: the first model the server lists
    tokenizer: str | None = None
    temperature: float = 0.0
    ignore_eos: bool = True
    timeout: float = 300.0
    warmup: int = 1
    percentiles: list[float] = field(default_factory=lambda: [50.0, 90.0, 99.0])
    slos: SLOs = field(default_factory=SLOs)
    api_key: str | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)
    progress: bool = True
    per_request: bool = True  # keep a per-request table in the report
    # A new connection per request, as a fleet of distinct clients makes them; llama-server closes a kept-alive
    # connection after a stream anyway, so reusing them would favour the servers that keep them.
    keep_alive: bool = False
    trace: str | None = None  # replay this trace (kvyard/bench/trace.py) instead of drawing the workload


class BenchError(Exception):
    pass


def check_loopback(url: str) -> str:
    """The base URL without a trailing /v1; refuses hosts other than this machine.

    A load generator pointed at someone else's server is an accident waiting to happen (and, in
    kvyard's test and benchmark setups, nothing off the machine is reachable anyway).
    """
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BenchError(f"--url must look like http://127.0.0.1:8000, got {url!r}")
    host = parts.hostname
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback:
        raise BenchError(f"--url must point at this machine (127.0.0.1, ::1 or localhost), got {host!r}")
    base = url.rstrip("/")
    return base.removesuffix("/v1")


async def discover_model(client: httpx.AsyncClient) -> str:
    r = await client.get("/v1/models")
    if r.status_code != 200:
        raise BenchError(f"GET /v1/models answered {r.status_code}: {r.text[:200]}")
    try:
        data = r.json().get("data") or []
    except (ValueError, AttributeError):
        raise BenchError(f"GET /v1/models did not answer with a model list: {r.text[:200]}") from None
    if not data:
        raise BenchError("the server lists no models; pass --model")
    return data[0]["id"]


async def _warmup(client: httpx.AsyncClient, sessions: list[Session], count: int, opts: RequestOptions) -> None:
    # Short requests of the workload's own shape: first-call costs (allocation, kernel selection, the
    # chat template's compilation) do not land in the first measured requests.
    start = time.perf_counter()
    for session in sessions[:count]:
        turn = session.turns[0]
        short = Session(session.endpoint, [Turn(turn.content, min(4, turn.max_tokens), turn.prompt_tokens)],
                        session.system, session.tools)
        results = await run_session(client, short, opts, start, lambda r: None)
        if not results[0].ok:
            raise BenchError(f"the warm-up request failed: {results[0].error}")


def sessions_for_load(cfg: ServeBenchConfig, tokenizer: Any, index: int) -> list[Session]:
    """The prompts of load `index` (-1: the warm-up): the workload drawn with its seed plus `index`, or the trace
    (the warm-up: its first request, sent at once)."""
    if cfg.trace is not None:
        try:
            sessions = read_trace(cfg.trace, tokenizer, cfg.workload.seed)
        except TraceError as e:
            raise BenchError(str(e)) from None
        return [replace(sessions[0], at_s=None)] if index < 0 else sessions
    return build_sessions(replace(cfg.workload, seed=cfg.workload.seed + index), tokenizer)


async def _run(cfg: ServeBenchConfig, warmup: list[Session], per_load: list[list[Session]]) -> dict[str, Any]:
    base = check_loopback(cfg.url)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    # A connection per request in flight, kept (or not) between requests; trust_env=False so no proxy
    # settings reroute loopback.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256 if cfg.keep_alive else 0)
    timeout = httpx.Timeout(cfg.timeout, connect=min(cfg.timeout, 30.0))
    async with httpx.AsyncClient(base_url=base, headers=headers, limits=limits, timeout=timeout,
                                 trust_env=False) as client:
        model = cfg.model or await discover_model(client)
        opts = RequestOptions(model=model, temperature=cfg.temperature, ignore_eos=cfg.ignore_eos,
                              timeout=cfg.timeout, extra_body=cfg.extra_body)
        await _warmup(client, warmup, cfg.warmup, opts)
        runs = []
        for load, sessions in zip(cfg.loads, per_load, strict=True):
            total = sum(len(s.turns) for s in sessions)
            desc = {"closed": f"c={load.concurrency}", "trace": f"trace x{load.time_scale:g}"}.get(
                load.mode, f"rate={load.rate:g}/s")
            with tqdm(total=total, desc=desc, unit="req", disable=not cfg.progress, leave=False) as bar:
                def tick(r: RequestResult) -> None:
                    bar.update(1)
                results, duration = await offer_load(client, sessions, load, opts, tick)
            summary = summarize(results, duration, cfg.percentiles, cfg.slos)
            run: dict[str, Any] = {"load": load.describe(), "summary": summary}
            if cfg.per_request:
                run["requests"] = request_records(results)
            runs.append(run)
    return {"model": model, "url": base, "runs": runs}


def run_benchmark(cfg: ServeBenchConfig) -> dict[str, Any]:
    """Run every load of `cfg` in turn and return the report (raises BenchError if the server is unusable)."""
    check_loopback(cfg.url)
    tokenizer = load_tokenizer(cfg.tokenizer) if cfg.tokenizer else None
    per_load = [sessions_for_load(cfg, tokenizer, i) for i in range(len(cfg.loads))]
    sessions = per_load[0]  # the workload's own seed: the one the report describes
    started = time.time()
    try:
        body = asyncio.run(_run(cfg, sessions_for_load(cfg, tokenizer, -1), per_load))
    except httpx.HTTPError as e:
        raise BenchError(f"cannot talk to {cfg.url}: {type(e).__name__}: {e}") from e
    return {
        "benchmark": "serve",
        "started_unix": started,
        **body,
        "workload": asdict(cfg.workload) | {
            "tokenizer": cfg.tokenizer,
            "requests": sum(len(s.turns) for s in sessions),
            "sessions": len(sessions),
            "intended_prompt_tokens": sum(t.prompt_tokens for s in sessions for t in s.turns),
        },
        "request": {"temperature": cfg.temperature, "ignore_eos": cfg.ignore_eos, "timeout_s": cfg.timeout,
                    "warmup": cfg.warmup, "extra_body": cfg.extra_body, "keep_alive": cfg.keep_alive},
        "percentiles": cfg.percentiles,
        "client": {"platform": platform.platform(), "python": platform.python_version()},
    }
