"""`kvyard lora promote`: shadow a newly trained adapter against what a served name does now, on live traffic,
and make it that name only if the comparison meets the bars that were stated.

Steps, against a running router and its workers (each started with `--enable-lora-runtime-updates`):
1. every healthy worker loads the adapter as `<name>-candidate`;
2. the router mirrors each live request for the primary model (`--primary`, default the name itself) to the
   candidate, through the router itself (POST /shadow), and compares each pair;
3. once `pairs` pairs are compared, the verdict's summary is held against the bars (`json_valid_candidate>=0.9`,
   `json_gain>=0.1`, `exact_match>=0.95`, `kl_mean<=0.01`, ...; `json_gain` is the candidate's share of JSON
   answers minus the primary's);
4. if every bar holds, every worker loads the adapter under the name itself: a reload under a name it served
   before gets a new digest, so no cached KV of the old adapter is reused;
5. whatever the outcome, the shadow is stopped and the candidate unloaded.
The adapter's path must be readable by every worker.
"""

import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvyard.errors import ConfigError, KvyardError

_BAR = re.compile(r"^\s*([a-z0-9_]+)\s*(>=|<=)\s*(-?[0-9.]+(?:e-?[0-9]+)?)\s*$")


@dataclass(frozen=True)
class Bar:
    metric: str
    op: str  # ">=" or "<="
    value: float

    @classmethod
    def parse(cls, text: str) -> "Bar":
        m = _BAR.match(text)
        if m is None:
            raise ConfigError(f"a bar is METRIC>=VALUE or METRIC<=VALUE, e.g. json_gain>=0.1 (got {text!r})",
                              param="bar")
        return cls(m[1], m[2], float(m[3]))

    def holds(self, figures: dict[str, float]) -> bool:
        """A figure nothing measured fails its bar."""
        got = figures.get(self.metric)
        if got is None:
            return False
        return got >= self.value if self.op == ">=" else got <= self.value

    def __str__(self) -> str:
        return f"{self.metric}{self.op}{self.value:g}"


@dataclass
class PromoteSettings:
    router: str  # the router's URL
    name: str  # the served name the adapter becomes
    adapter: str  # its directory (PEFT format), readable by every worker
    bars: list[Bar] = field(default_factory=list)
    primary: str | None = None  # the model whose requests are mirrored (default: `name`)
    pairs: int = 32  # compared pairs before the verdict
    timeout_s: float = 600.0  # for the pairs to arrive
    poll_s: float = 1.0

    def __post_init__(self) -> None:
        self.router = self.router.rstrip("/")
        if not self.bars:
            raise ConfigError("promotion needs at least one bar (--bar METRIC>=VALUE)", param="bar")
        if self.pairs < 1 or self.timeout_s <= 0:
            raise ConfigError("pairs must be at least 1 and the timeout positive", param="pairs")


def promote(s: PromoteSettings, client: httpx.Client | None = None) -> dict[str, Any]:
    client = client or httpx.Client(timeout=120.0, trust_env=False)
    candidate = f"{s.name}-candidate"
    workers = _healthy_workers(client, s.router)
    try:
        for url in workers:
            _load(client, url, candidate, s.adapter)
        _post(client, f"{s.router}/shadow", {"url": s.router, "models": [s.primary or s.name],
                                             "candidate_model": candidate, "score": 0.0, "keep": s.pairs})
        summary = _wait_for_pairs(client, s)
        figures = {**summary, "json_gain": summary["json_valid_candidate"] - summary["json_valid_primary"]}
        checked = [{"bar": str(b), "value": figures.get(b.metric), "holds": b.holds(figures)} for b in s.bars]
        promoted = all(c["holds"] for c in checked)
        if promoted:
            for url in workers:
                _load(client, url, s.name, s.adapter)
    finally:
        _cleanup(client, s.router, workers, candidate)
    return {"name": s.name, "adapter": s.adapter, "primary": s.primary or s.name, "workers": workers,
            "promoted": promoted, "bars": checked, "summary": figures}


def _healthy_workers(client: httpx.Client, router: str) -> list[str]:
    r = client.get(f"{router}/workers")
    if r.status_code != 200:
        raise KvyardError(f"{router}/workers answered {r.status_code}: {r.text[:200]}")
    workers = [w["url"] for w in r.json()["workers"] if w["status"] == "healthy"]
    if not workers:
        raise KvyardError(f"{router} has no healthy worker to load the adapter on")
    return workers


def _post(client: httpx.Client, url: str, body: dict[str, Any]) -> httpx.Response:
    r = client.post(url, json=body)
    if r.status_code != 200:
        raise KvyardError(f"{url} answered {r.status_code}: {r.text[:300]}")
    return r


def _load(client: httpx.Client, worker: str, name: str, path: str) -> None:
    _post(client, f"{worker}/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})


def _wait_for_pairs(client: httpx.Client, s: PromoteSettings) -> dict[str, float]:
    deadline = time.monotonic() + s.timeout_s
    compared = 0.0
    while time.monotonic() < deadline:
        r = client.get(f"{s.router}/shadow")
        if r.status_code == 200:
            summary = r.json()["summary"]
            compared = summary.get("requests", 0.0)
            if compared >= s.pairs:
                return summary
        time.sleep(s.poll_s)
    raise KvyardError(f"only {compared:.0f} of {s.pairs} pairs were compared in {s.timeout_s:g} s: is live traffic "
                      f"reaching model {s.primary or s.name!r} through {s.router}?")


def _cleanup(client: httpx.Client, router: str, workers: list[str], candidate: str, wait_s: float = 30.0) -> None:
    """Stop the shadow, then unload the candidate from every worker: refused while a mirrored request is still
    running with it, so retried for up to `wait_s`. Best effort: a worker that is gone has nothing to unload."""
    try:
        client.delete(f"{router}/shadow")
    except httpx.HTTPError:
        pass
    deadline = time.monotonic() + wait_s
    left = list(workers)
    while left and time.monotonic() < deadline:
        for url in list(left):
            try:
                r = client.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": candidate})
            except httpx.HTTPError:
                left.remove(url)
                continue
            if r.status_code != 409:  # done, or nothing to unload; 409: a request still runs with it
                left.remove(url)
        if left:
            time.sleep(0.2)


def print_report(report: dict[str, Any]) -> None:
    for c in report["bars"]:
        value = "not measured" if c["value"] is None else f"{c['value']:.4g}"
        print(f"  {'ok  ' if c['holds'] else 'FAIL'} {c['bar']:28s} {value}")
    verb = "promoted: " if report["promoted"] else "not promoted: "
    print(verb + f"{report['adapter']} {'is now' if report['promoted'] else 'stays out of'} {report['name']!r} "
          f"on {len(report['workers'])} worker(s)")
    print(json.dumps(report["summary"], indent=2))
