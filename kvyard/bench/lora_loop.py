"""`kvyard bench lora-loop`: from captured traffic to a better adapter, on a running server (#39).

The task: answer a sentence about a person and a city with exactly `{"name": ..., "city": ...}`. The clients'
traffic carries an instruction that asks for it; the adapter should make the instruction unnecessary.
1. A `kvyard serve` worker (capture on, run-time adapter updates on) takes `--train-requests` chat requests,
   each the instruction and a sentence, and captures them.
2. `kvyard lora train` reads the capture, drops the instruction from the prompts, keeps only the answers that
   are JSON (the chosen completions), and fits an adapter.
3. `kvyard lora promote` loads it into the running worker as a candidate and shadows it against the base model
   on live traffic (bare sentences, through a router in front of the worker): it becomes the served model
   `task` only if the stated bars hold (default: at least 50 points more JSON answers than the base).
4. Held-out sentences, with names and cities that no training sentence has, are sent to the base model with
   and without the instruction and to `task` without it, greedy; the task metric is the share of exact
   answers. The gain is the adapter's share minus the base's on the same bare prompts.
"""

import argparse
import concurrent.futures
import json
import random
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from kvyard.bench.output import emit_json, machine_info
from kvyard.errors import KvyardError
from kvyard.lora.data import KEEP
from kvyard.lora.promote import Bar, PromoteSettings, print_report, promote
from kvyard.lora.train import TrainSettings, train_adapter
from kvyard.router.launcher import Cluster, ClusterSpec

INSTRUCTION = 'Reply with only a JSON object with the keys "name" and "city".\n'
TEMPLATES = ["{name} moved to {city} last year.", "{name} was born in {city}.",
             "Yesterday {name} flew to {city} for work.", "{name} has lived in {city} for ten years.",
             "After school, {name} found a job in {city}.", "{name} visits {city} every summer."]
# Training and held-out sentences share no name and no city: the gain is the format, not memorised answers.
TRAIN_NAMES = ["Maria", "John", "Aiko", "Pedro", "Fatima", "Lars", "Chen", "Amara", "Olga", "Ravi", "Sofia",
               "Omar", "Elena", "Kwame", "Yuki", "Hugo", "Leila", "Marco", "Anya", "Diego"]
TRAIN_CITIES = ["Lisbon", "Boston", "Osaka", "Lima", "Cairo", "Oslo", "Beijing", "Lagos", "Kyiv", "Delhi", "Madrid",
                "Seoul", "Quito", "Accra", "Hanoi", "Dublin", "Prague", "Manila", "Denver", "Zurich"]
HELD_NAMES = ["Nadia", "Tom", "Ines", "Kofi", "Mei", "Igor", "Lucia", "Sami", "Greta", "Arjun"]
HELD_CITIES = ["Paris", "Rome", "Tokyo", "Nairobi", "Perth", "Riga", "Havana", "Vienna", "Austin", "Bogota"]


def task_items(count: int, names: list[str], cities: list[str], seed: int) -> list[tuple[str, dict[str, str]]]:
    rng = random.Random(seed)
    items = []
    for _ in range(count):
        answer = {"name": rng.choice(names), "city": rng.choice(cities)}
        items.append((rng.choice(TEMPLATES).format(**answer), answer))
    return items


def is_exact(text: str, answer: dict[str, str]) -> bool:
    try:
        return json.loads(text.strip()) == answer
    except ValueError:
        return False


def _ask(client: httpx.Client, url: str, model: str, content: str, max_tokens: int) -> dict[str, Any]:
    r = client.post(f"{url}/v1/chat/completions", json={
        "model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
        "temperature": 0.0})
    if r.status_code != 200:
        raise KvyardError(f"bench lora-loop: {url} answered {r.status_code}: {r.text[:300]}")
    return r.json()


def ask_all(url: str, model: str, contents: list[str], max_tokens: int, concurrency: int) -> list[dict[str, Any]]:
    with httpx.Client(timeout=120.0) as client, concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda c: _ask(client, url, model, c, max_tokens), contents))


def evaluate(url: str, model: str, items: list[tuple[str, dict[str, str]]], instructed: bool, max_tokens: int,
             concurrency: int) -> dict[str, float]:
    replies = ask_all(url, model, [(INSTRUCTION if instructed else "") + s for s, _ in items], max_tokens, concurrency)
    texts = [r["choices"][0]["message"]["content"] for r in replies]
    return {"exact": sum(is_exact(t, a) for t, (_, a) in zip(texts, items, strict=True)) / len(items),
            "prompt_tokens": sum(r["usage"]["prompt_tokens"] for r in replies) / len(replies),
            "example": texts[0]}


class BackgroundTraffic:
    """Clients sending `contents` (chat turns, greedy) to `model` in turn on a thread of their own, until stopped
    or `limit` requests are sent: the live traffic a shadow needs."""

    def __init__(self, url: str, model: str, contents: list[str], max_tokens: int, limit: int = 1000):
        self.stop, self.sent = threading.Event(), 0
        self._args = (url, model, contents, max_tokens, limit)
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        url, model, contents, max_tokens, limit = self._args
        with httpx.Client(timeout=120.0) as client:
            while not self.stop.is_set() and self.sent < limit:
                _ask(client, url, model, contents[self.sent % len(contents)], max_tokens)
                self.sent += 1

    def __enter__(self) -> "BackgroundTraffic":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(120)


def _wait_for_capture(capture: Path, count: int, timeout: float) -> Path:
    """The capture's records, gathered in one file once all `count` are written."""
    deadline = time.monotonic() + timeout
    while True:
        lines = [line for f in sorted(capture.glob("capture-*.jsonl")) for line in f.read_text().splitlines()]
        if len(lines) >= count:
            out = capture / "all.jsonl"
            out.write_text("\n".join(lines) + "\n")
            return out
        if time.monotonic() > deadline:
            raise KvyardError(f"bench lora-loop: {len(lines)} of {count} requests captured in {timeout:.0f} s")
        time.sleep(0.5)


def run_loop(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    spec = ClusterSpec(replicas=1, model=args.model, worker_port=args.port + 1, log_dir=root,
                       serve_args=["--capture", str(root / "capture"), "--enable-lora-runtime-updates",
                                   "--dtype", args.dtype])
    cluster = Cluster(spec)
    try:
        [worker] = cluster.start_workers()
        cluster.wait_ready([worker], args.startup_timeout)
        url = cluster.start_router(args.port, "round-robin")
        cluster.wait_ready([url], args.startup_timeout)
        model = httpx.get(f"{worker}/v1/models", timeout=10).json()["data"][0]["id"]
        train_items = task_items(args.train_requests, TRAIN_NAMES, TRAIN_CITIES, seed=1)
        started = time.perf_counter()
        ask_all(url, model, [INSTRUCTION + s for s, _ in train_items], args.max_tokens, args.concurrency)
        capture = _wait_for_capture(root / "capture", len(train_items), 60.0)
        capture_s = time.perf_counter() - started
        report = train_adapter(TrainSettings(
            model=args.model, data=str(capture), out=str(root / "adapter"), drop=[INSTRUCTION], keep=args.keep,
            rank=args.rank, epochs=args.epochs, held_out=0.1, seed=0, progress=True))
        live = [s for s, _ in task_items(64, TRAIN_NAMES, TRAIN_CITIES, seed=3)]  # today's clients, bare
        with BackgroundTraffic(url, model, live, args.max_tokens):
            promotion = promote(PromoteSettings(router=url, name="task", adapter=str(root / "adapter"),
                                                bars=[Bar.parse(b) for b in args.bar], primary=model,
                                                pairs=args.shadow_pairs, timeout_s=args.startup_timeout))
        held = task_items(args.eval_requests, HELD_NAMES, HELD_CITIES, seed=2)
        runs = {"base_bare": evaluate(url, model, held, False, args.max_tokens, args.concurrency),
                "base_instructed": evaluate(url, model, held, True, args.max_tokens, args.concurrency)}
        if promotion["promoted"]:
            runs["adapter_bare"] = evaluate(url, "task", held, False, args.max_tokens, args.concurrency)
    finally:
        cluster.stop()
    return {"model": args.model, "dtype": args.dtype, "train_requests": args.train_requests,
            "eval_requests": args.eval_requests, "capture_s": round(capture_s, 1),
            "train_examples": report["examples"], "train_s": report["seconds"], "steps": report["steps"],
            "held_out_loss": [report["held_out_before"]["loss"], report["held_out_after"]["loss"]],
            "promotion": {k: promotion[k] for k in ("promoted", "bars", "summary")}, "eval": runs,
            "gain": runs["adapter_bare"]["exact"] - runs["base_bare"]["exact"] if "adapter_bare" in runs else None,
            "machine": machine_info()}


def run_lora_loop_bench(args: argparse.Namespace) -> int:
    args.bar = args.bar or ["json_gain>=0.5"]
    with tempfile.TemporaryDirectory(prefix="kvyard-lora-loop-") as tmp:
        root = Path(args.work_dir) if args.work_dir else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        result = run_loop(args, root)
    e = result["eval"]
    print(f"captured {result['train_requests']} requests in {result['capture_s']} s; trained on "
          f"{result['train_examples']['train']} chosen answers in {result['train_s']} s ({result['steps']} steps)")
    print_report({**result["promotion"], "adapter": "the trained adapter", "name": "task", "workers": [1]})
    for name, run in e.items():
        print(f"{name:16s} exact {run['exact']:.1%}  prompt tokens {run['prompt_tokens']:.1f}")
    if result["gain"] is not None:
        print(f"held-out gain (adapter vs base, same bare prompts): {result['gain']:+.1%}")
    emit_json(result, args.json_out)
    return 0


def add_lora_loop_bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("lora-loop", help="capture a task's traffic, train an adapter, hot-load it, measure the gain")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--port", type=int, default=8491)
    p.add_argument("--train-requests", type=int, default=240)
    p.add_argument("--eval-requests", type=int, default=100)
    p.add_argument("--max-tokens", type=int, default=40)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--keep", choices=sorted(KEEP), default="json", help="which captured answers are trained on")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--bar", action="append", default=None, metavar="METRIC>=VALUE",
                   help="the promotion's bars (repeatable; default json_gain>=0.5)")
    p.add_argument("--shadow-pairs", type=int, default=24, help="live requests compared before the promotion")
    p.add_argument("--startup-timeout", type=float, default=180.0)
    p.add_argument("--work-dir", help="keep the capture, the adapter and the logs here (default: a temporary dir)")
    p.add_argument("--json-out")
    p.set_defaults(func=run_lora_loop_bench)
