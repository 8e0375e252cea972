"""`kvyard bench graft`: a vision graft served, asked easy-VQA's held-out questions over HTTP (#40).

    kvyard bench graft --graft GRAFTDIR --questions 300

Starts `kvyard serve --model GRAFTDIR` on a loopback port and sends each question twice at `--concurrency`: with
its image (a PNG data URL, as an OpenAI client sends it) and as text alone. It reports exact-match accuracy per
question type for each, the throughput of the image pass, and the server's image-cache and prefix-cache counters
(easy-VQA asks several questions of each image, so the encoder cache answers the repeats). A second pass with
the images shows the warm caches.
"""

import argparse
import asyncio
import base64
import random
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import httpx

from kvyard.bench.compare_serve import ManagedServer, wait_port_free
from kvyard.bench.output import emit_json
from kvyard.bench.route import delta, scrape
from kvyard.vision.easy_vqa import Question, read_split
from kvyard.vision.graft import PLACEHOLDER, answers


def _messages(q: Question, with_image: bool) -> list[dict[str, Any]]:
    if not with_image:
        return [{"role": "user", "content": q.question}]
    url = "data:image/png;base64," + base64.b64encode(q.image.read_bytes()).decode()
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": q.question}]}]


async def _ask_all(url: str, questions: list[Question], with_image: bool, concurrency: int) -> dict[str, Any]:
    """Exact-match accuracy per question type, and the pass's wall time."""
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120,
                                http_client=httpx.AsyncClient(trust_env=False, timeout=120))
    gate = asyncio.Semaphore(concurrency)
    hits: dict[str, list[bool]] = defaultdict(list)

    async def one(q: Question) -> None:
        async with gate:
            reply = await client.chat.completions.create(model="graft", messages=_messages(q, with_image),
                                                         max_tokens=4, temperature=0)
        hit = answers(reply.choices[0].message.content or "", q.answer)
        hits[q.kind].append(hit)
        hits["all"].append(hit)

    start = time.perf_counter()
    await asyncio.gather(*(one(q) for q in questions))
    seconds = time.perf_counter() - start
    await client.close()
    accuracy = {kind: round(sum(h) / len(h), 4) for kind, h in sorted(hits.items())}
    return {"accuracy": accuracy, "seconds": round(seconds, 2), "requests_per_s": round(len(questions) / seconds, 2)}


# The /metrics counters each pass reports (their increase over it)
COUNTERS = ("kvyard_vision_encoder_runs_total", "kvyard_vision_cache_hits_total", "kvyard_prefix_cache_queries_total",
            "kvyard_prefix_cache_hits_total")


def _counted(after: dict, before: dict) -> dict[str, float]:
    return {n.removeprefix("kvyard_").removesuffix("_total"): delta(after, before, n) for n in COUNTERS}


def run_graft_bench(args: argparse.Namespace) -> int:
    questions = random.Random(args.seed).sample(read_split("test"), args.questions)
    cmd = (f"{sys.executable} -m kvyard.cli.main serve --model {args.graft} --port {{port}} --log-level warning "
           f"--dtype {args.dtype} --served-model-name graft")
    wait_port_free(args.port)
    with tempfile.TemporaryDirectory(prefix="kvyard-bench-graft-") as tmp:
        server = ManagedServer(cmd, args.port, Path(tmp) / "server.log")
        try:
            server.wait_ready(args.startup_timeout)
            passes = {}
            for name, with_image in (("text_only", False), ("graft", True), ("graft_warm", True)):
                before = scrape(server.url)
                passes[name] = asyncio.run(_ask_all(server.url, questions, with_image, args.concurrency))
                passes[name]["counters"] = _counted(scrape(server.url), before)
        finally:
            server.stop()
    result = {"graft": str(args.graft), "questions": args.questions, "seed": args.seed, "dtype": args.dtype,
              "concurrency": args.concurrency, "placeholder": PLACEHOLDER, **passes}
    for name in passes:
        p = passes[name]
        print(f"{name:10s} accuracy {p['accuracy']}  {p['requests_per_s']} req/s  {p['counters']}")
    emit_json(result, args.json_out)
    return 0


def add_graft_bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("graft", help="serve a vision graft and ask it easy-VQA's held-out questions over HTTP")
    p.add_argument("--graft", required=True, help="the graft's directory (kvyard graft vision --out)")
    p.add_argument("--questions", type=int, default=300, help="drawn from easy-VQA's test split")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", help="the language model's dtype on the server")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--port", type=int, default=8493)
    p.add_argument("--startup-timeout", type=float, default=180.0)
    p.add_argument("--json-out")
    p.set_defaults(func=run_graft_bench)
