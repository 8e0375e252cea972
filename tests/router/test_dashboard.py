"""The operator's console: /dashboard/data holds what the router saw, and /dashboard, loaded in a real
headless Chromium (Debian's package; .ci/run installs it), shows exactly those figures. A screenshot of
the page is saved next to the test's files."""

import shutil
import subprocess
from html.parser import HTMLParser

import httpx
import pytest

from tests.router.harness import running_router, running_worker, start_streams
from tests.server.harness import wait_until

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
HEADLESS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
            "--hide-scrollbars", "--virtual-time-budget=8000"]


class _Tables(HTMLParser):
    """Texts of every table row's cells by table id, and of every element with an id."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: dict[str, list[list[str]]] = {}
        self.ids: dict[str, str] = {}
        self._table: str | None = None
        self._cell: list[str] | None = None
        self._open_id: list[tuple[str, str]] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "table":
            self._table = a.get("id")
            self.tables[self._table] = []
        elif tag == "tr" and self._table:
            self.tables[self._table].append([])
        elif tag in ("td", "th"):
            self._cell = []
        if a.get("id") and tag not in ("table", "tbody", "tr"):
            self._open_id.append((tag, a["id"]))
            self.ids[a["id"]] = ""

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None and self._table:
            self.tables[self._table][-1].append("".join(self._cell).strip())
            self._cell = None
        elif tag == "table":
            self._table = None
        if self._open_id and self._open_id[-1][0] == tag:
            self._open_id.pop()

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)
        for _, element_id in self._open_id:
            self.ids[element_id] += data


def rendered(url: str) -> _Tables:
    out = subprocess.run([CHROMIUM, *HEADLESS, "--dump-dom", url], capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr[-2000:]
    page = _Tables()
    page.feed(out.stdout)
    return page


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium here (.ci/run installs Debian's package)")
def test_the_console_shows_what_the_json_holds(make_engine, tokenizer, tiny_path, tmp_path):
    engine = make_engine()
    with running_worker(engine) as worker, running_router(tokenizer, workers=[worker.url], model=str(tiny_path),
                                                          health_interval=0.2) as router:
        assert wait_until(lambda: router.workers()[worker.url]["status"] == "healthy", 20)
        body = {"prompt": "Once upon a time", "max_tokens": 12, "ignore_eos": True, "stream": True}
        runs = start_streams(router.url, body, 5)
        for run in runs:
            run.thread.join(30)
            assert run.lines[-1] == "[DONE]"
        httpx.post(router.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, trust_env=False)
        # Sampled and settled: nothing running or queued, so the JSON and the page, read a moment apart, agree.
        assert wait_until(lambda: router.workers()[worker.url]["running"] == 0
                          and router.workers()[worker.url]["waiting"] == 0, 10)
        data = httpx.get(router.url + "/dashboard/data", trust_env=False).json()

        assert data["healthy"] == 1 and data["policy"] == "kv"
        assert sum(data["decisions"][worker.url].values()) == 6  # 5 streams and one plain request
        assert data["latency"]["ttft"]["count"] == 5 and data["latency"]["itl"]["count"] >= 5  # events, not tokens
        assert 0 < data["latency"]["ttft"]["p50"] <= data["latency"]["ttft"]["p99"]

        page = rendered(router.url + "/dashboard")
        assert page.ids["error"] == "" and page.ids["healthy"] == "1" and page.ids["policy"] == "kv"
        assert page.ids["repetition-trips"] == _num(data["repetition_trips"])
        (replica,) = [r for r in page.tables["replicas"] if r and r[0] == worker.url]
        (w,) = data["replicas"]
        assert replica[1:6] == [w["role"], w["status"], str(w["in_flight"]), _num(w["running"]), _num(w["waiting"])]
        assert replica[6] == f"{100 * w['kv_usage']:.1f} %" and replica[7] == f"{100 * w['observed_hit_rate']:.1f} %"
        (decided,) = [r for r in page.tables["decisions"] if r and r[0] == worker.url]
        assert decided[1] == "6"
        latency = {r[0]: r[1:] for r in page.tables["latency"] if r and r[0] in ("TTFT", "ITL")}
        for name in ("ttft", "itl"):
            j = data["latency"][name]
            assert latency[name.upper()] == [f"{j['p50']:.2f}", f"{j['p90']:.2f}", f"{j['p99']:.2f}", str(j["count"])]

        shot = tmp_path / "dashboard.png"
        subprocess.run([CHROMIUM, *HEADLESS, "--window-size=1280,900", f"--screenshot={shot}",
                        router.url + "/dashboard"], capture_output=True, timeout=90, check=True, cwd=tmp_path)
        assert shot.stat().st_size > 10_000 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        print(f"\nscreenshot: {shot}")


def _num(v: float) -> str:
    """A number as JavaScript's textContent writes it (2.0 -> "2")."""
    return str(int(v)) if float(v).is_integer() else str(v)


def test_dashboard_data_without_a_browser(make_engine, tokenizer, tiny_path):
    engine = make_engine()
    with running_worker(engine) as worker, running_router(tokenizer, workers=[worker.url], model=str(tiny_path)) as router:
        assert wait_until(lambda: router.workers()[worker.url]["status"] == "healthy", 20)
        assert "kvyard router" in httpx.get(router.url + "/dashboard", trust_env=False).text
        data = httpx.get(router.url + "/dashboard/data", trust_env=False).json()
        assert data["latency"]["ttft"] == {"count": 0, "p50": None, "p90": None, "p99": None}
        assert data["decisions"] == {} and data["replicas"][0]["url"] == worker.url
