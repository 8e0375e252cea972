"""Mirroring through the router: a live candidate gets a copy of each request and its answers are kept; a dead or
hanging candidate changes nothing a client sees, and is skipped and counted."""

import socket
import time

import httpx
import pytest

from kvyard.errors import ConfigError
from kvyard.net import free_port
from kvyard.router.config import RouterSettings
from tests.router.conftest import make_engine, tiny_path, tokenizer  # noqa: F401 - the router tests' fixtures
from tests.router.harness import running_router, running_worker
from tests.server.harness import running_server, wait_until

ASK = {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0, "ignore_eos": True}


def _shadow_counts(router) -> dict[str, float]:
    counts = {}
    for line in httpx.get(router.url + "/metrics", timeout=5, trust_env=False).text.splitlines():
        if line.startswith("kvyard_router_shadow_requests_total{"):
            outcome = line.split('outcome="')[1].split('"')[0]
            counts[outcome] = float(line.rsplit(" ", 1)[1])
    return counts


def _ask(router, **extra) -> tuple[str, float]:
    started = time.monotonic()
    r = httpx.post(router.url + "/v1/completions", json={**ASK, **extra}, timeout=60, trust_env=False)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"], time.monotonic() - started


def test_a_live_candidate_answers_every_mirrored_request(make_engine, tokenizer, tiny_path):  # noqa: F811
    with running_worker(make_engine()) as worker, running_server(make_engine()) as candidate, \
            running_router(tokenizer, workers=[worker.url], model=str(tiny_path), shadow=candidate.url) as router:
        texts = [_ask(router, prompt=f"{ASK['prompt']} {i}")[0] for i in range(3)]
        mirror = router.app.state.router.shadow.mirror
        assert wait_until(lambda: len(mirror.pairs) == 3, 30)
        # the same model and settings: the candidate's text is the primary's, request for request
        assert sorted(p.candidate.text for p in mirror.pairs) == sorted(texts)
        assert all(p.primary.text == p.candidate.text for p in mirror.pairs)
        assert _shadow_counts(router) == {"sent": 3.0, "ok": 3.0}


def test_a_dead_candidate_is_skipped_and_clients_see_nothing(make_engine, tokenizer, tiny_path):  # noqa: F811
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with running_worker(make_engine()) as worker, running_router(
            tokenizer, workers=[worker.url], model=str(tiny_path),
            shadow={"url": dead, "dead_after": 2, "retry_after_s": 60}) as router:
        mirror = router.app.state.router.shadow.mirror
        for _ in range(4):
            _ask(router)
            assert wait_until(lambda: mirror.in_flight == 0, 10)
        assert _shadow_counts(router) == {"sent": 2.0, "failed": 2.0, "skipped_down": 2.0}


def test_a_hanging_candidate_never_slows_the_primary(make_engine, tokenizer, tiny_path):  # noqa: F811
    with socket.socket() as hang:  # accepts connections and never answers
        hang.bind(("127.0.0.1", 0))
        hang.listen(16)
        url = f"http://127.0.0.1:{hang.getsockname()[1]}"
        with running_worker(make_engine()) as worker, running_router(
                tokenizer, workers=[worker.url], model=str(tiny_path),
                shadow={"url": url, "max_in_flight": 1, "timeout_s": 30}) as router:
            alone = max(_ask(router)[1] for _ in range(3))  # the first went to the candidate and hangs there
            assert alone < 10
            assert _shadow_counts(router) == {"sent": 1.0, "skipped_busy": 2.0}


def test_shadow_settings_are_checked():
    assert RouterSettings(shadow="http://127.0.0.1:9/v1/").shadow.url == "http://127.0.0.1:9"
    with pytest.raises(ConfigError, match="sample"):
        RouterSettings(shadow={"url": "http://127.0.0.1:9", "sample": 2})
    with pytest.raises(ConfigError, match="shadow"):
        RouterSettings(shadow={"url": "http://127.0.0.1:9", "rate": 0.5})


def test_the_shadow_flag_takes_a_url_or_a_json_object(capsys):
    from kvyard.cli.main import build_parser
    from kvyard.cli.route import router_settings

    def settings(value: str):
        args = build_parser().parse_args(["route", "--worker", "http://127.0.0.1:9", "--shadow", value])
        return router_settings(args, args.worker, 8000).shadow

    assert settings("http://127.0.0.1:7").url == "http://127.0.0.1:7"
    full = settings('{"url": "http://127.0.0.1:7", "score": 0.25, "record": "pairs.jsonl", "max_in_flight": 64}')
    assert (full.score, full.record, full.max_in_flight) == (0.25, "pairs.jsonl", 64)
    with pytest.raises(SystemExit):
        settings('{"url": ')
    assert "not a JSON object" in capsys.readouterr().err
