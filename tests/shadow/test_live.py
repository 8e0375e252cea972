"""Live comparison in the router: each mirrored request's two answers are read as they are relayed, scored off
the serving path (teacher-forced KL through both sides' prompt_logprobs), counted in /metrics, summed up at
GET /shadow and written to the record for `kvyard shadow report`."""

import json

import httpx
import pytest

from kvyard.cli.main import build_parser, main
from kvyard.errors import ConfigError
from kvyard.net import free_port
from kvyard.quant.tool import QuantizeOptions, quantize_model
from tests.router.conftest import make_engine, tiny_path, tokenizer  # noqa: F401 - the router tests' fixtures
from tests.router.harness import running_router, running_worker
from tests.server.harness import running_server, wait_until

ASKS = [  # streamed and not, completions and chat: every way the primary's answer is read
    ("/v1/completions", {"prompt": "Once upon a time", "stream": True}),
    ("/v1/completions", {"prompt": "The quick brown fox"}),
    ("/v1/completions", {"prompt": [40, 41, 42, 43, 44, 45]}),  # token ids: the record adds their text
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Say hello"}], "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Count to three"}]}),
]


def _ask(url: str, path: str, body: dict) -> str:
    body = {**body, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    r = httpx.post(url + path, json=body, timeout=60, trust_env=False)
    assert r.status_code == 200, r.text
    if not body.get("stream"):
        choice = r.json()["choices"][0]
        return choice["message"]["content"] if "message" in choice else choice["text"]
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    return "".join(c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get("content") or ""
                   for c in chunks if c["choices"])


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


@pytest.fixture(scope="module")
def int4_head(tiny_path, tmp_path_factory):  # noqa: F811
    """The issue's degraded example: int4 weights with the LM head quantized (int4) as well."""
    out = tmp_path_factory.mktemp("int4-head")
    quantize_model(QuantizeOptions(model=str(tiny_path), out=out, scheme="int4-g32", head_scheme="int4-g32",
                                   dtype="float32", progress=False, max_seq_len=64, sensitivity=False,
                                   tool_eval=False))
    return out


@pytest.mark.parametrize("degraded", [False, True], ids=["identical", "int4-head"])
def test_pairs_are_scored_live(make_engine, tokenizer, tiny_path, tmp_path, request, degraded):  # noqa: F811
    candidate_options = {"model": str(request.getfixturevalue("int4_head"))} if degraded else {}
    record = tmp_path / "pairs.jsonl"
    # The candidate serves under a name of its own, as a new deployment would: candidate_model is what it is sent.
    with running_worker(make_engine()) as worker, \
            running_server(make_engine(**candidate_options), served_model_name="candidate") as candidate, \
            running_router(tokenizer, workers=[worker.url], model=str(tiny_path),
                           shadow={"url": candidate.url, "record": str(record), "candidate_model": "candidate"}) \
            as router:
        texts = [_ask(router.url, path, {**body, "model": str(tiny_path)}) for path, body in ASKS]
        comparator = router.app.state.router.shadow.comparator
        assert wait_until(lambda: len(comparator.scores) == len(ASKS), 60)
        report = httpx.get(router.url + "/shadow", timeout=10, trust_env=False).json()
        metrics = httpx.get(router.url + "/metrics", timeout=10, trust_env=False).text
    pairs = [json.loads(line) for line in record.read_text().splitlines()]
    assert sorted(p["primary"]["text"] for p in pairs) == sorted(texts)  # what the clients were sent
    assert all(p["score"]["scored_tokens"] > 0 and p["score"]["greedy"] for p in pairs)
    (ids,) = [p["request"] for p in pairs if "prompt_text" in p["request"]]
    assert ids["prompt_text"] == tokenizer.decode(ids["prompt"])
    assert _metric(metrics, 'kvyard_shadow_pairs_total{outcome="scored"}') == len(ASKS)
    assert _metric(metrics, "kvyard_shadow_kl_count") == len(ASKS)
    summary = report["summary"]
    if not degraded:
        assert summary["kl_mean"] < 1e-6 and summary["exact_match"] == 1.0 and summary["top1_agreement"] == 1.0
        assert all(p["candidate"]["text"] == p["primary"]["text"] for p in pairs)
        assert _metric(metrics, 'kvyard_shadow_exact_match_total{match="true"}') == len(ASKS)
    else:  # int4 weights and head: flagged, the worst pair first
        assert not report["passed"] and summary["kl_mean"] > 1e-4 and summary["exact_match"] < 1
        assert any(f.startswith("exact_match") for f in report["failures"])
        assert report["worst"][0]["kl_mean"] == max(p["score"]["kl_mean"] for p in pairs)
    _check_report(record, tmp_path / "report", pairs, passes=not degraded)


def _check_report(record, out, pairs: list[dict], passes: bool) -> None:
    """`kvyard shadow report` on the record: the verdict as the exit code, the worst pair first with its texts."""
    assert main(["shadow", "report", str(record), "--out", str(out), "--ttft-delta-s", "60"]) == (0 if passes else 1)
    md = (out / "report.md").read_text()
    assert md.startswith(f"# Shadow report: {'PASS' if passes else 'FAIL'}")
    worst = max(pairs, key=lambda p: p["score"]["kl_mean"])
    assert md.index(worst["id"]) < min(md.index(p["id"]) for p in pairs if p["id"] != worst["id"])
    assert worst["candidate"]["text"][:50] in md
    saved = json.loads((out / "report.json").read_text())
    assert saved["passed"] is passes and saved["counts"] == {"pairs": len(pairs), "scored": len(pairs)}
    assert (out / "report.png").read_bytes().startswith(b"\x89PNG")


def test_a_broken_record_is_named():
    with pytest.raises(ConfigError, match="no shadow record"):
        main_raising(["shadow", "report", "/nonexistent/pairs.jsonl"])


def test_redaction_keeps_no_text_and_failed_candidates_are_recorded(make_engine, tokenizer, tiny_path,  # noqa: F811
                                                                      tmp_path):
    record = tmp_path / "pairs.jsonl"
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with running_worker(make_engine()) as worker, running_router(
            tokenizer, workers=[worker.url], model=str(tiny_path),
            shadow={"url": dead, "record": str(record), "redact": True}) as router:
        secret = "my secret password is swordfish"
        _ask(router.url, "/v1/completions", {"prompt": secret})
        comparator = router.app.state.router.shadow.comparator
        assert wait_until(lambda: record.exists() and record.read_text().count("\n") == 1, 30)
        metrics = httpx.get(router.url + "/metrics", timeout=10, trust_env=False).text
    text = record.read_text()
    assert "swordfish" not in text and "secret" not in text
    (line,) = [json.loads(x) for x in text.splitlines()]
    assert line["score"] is None and "ConnectError" in line["errors"]["candidate"]
    assert _metric(metrics, 'kvyard_shadow_pairs_total{outcome="candidate_failed"}') == 1
    assert not comparator.scores


def main_raising(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


def test_a_record_with_a_bad_line_is_named(tmp_path):
    record = tmp_path / "pairs.jsonl"
    record.write_text('{"id": "a", "score": null}\nnot json\n')
    with pytest.raises(ConfigError, match=r"pairs.jsonl:2: not a JSON line"):
        main_raising(["shadow", "report", str(record), "--out", str(tmp_path / "out")])


def test_scoring_waits_for_the_primary_to_be_idle(make_engine, tokenizer, tiny_path, tmp_path):  # noqa: F811
    """score_when_idle: the primary's worker is never idle here, so the pair is compared without teacher-forcing
    (no KL measured) and counted; the client's answer is unaffected."""
    record = tmp_path / "pairs.jsonl"
    with running_worker(make_engine()) as worker, running_server(make_engine()) as candidate, \
            running_router(tokenizer, workers=[worker.url], model=str(tiny_path),
                           shadow={"url": candidate.url, "record": str(record), "timeout_s": 2}) as router:
        comparator = router.app.state.router.shadow.comparator
        comparator.in_flight = lambda url: 1  # as if a client request were always in flight there
        text = _ask(router.url, *ASKS[1])
        assert wait_until(lambda: len(comparator.scores) == 1, 30)
        metrics = httpx.get(router.url + "/metrics", timeout=10, trust_env=False).text
    (line,) = [json.loads(x) for x in record.read_text().splitlines()]
    assert line["primary"]["text"] == text and line["score"]["scored_tokens"] == 0
    assert "never idle" in line["errors"]["score"]
    assert _metric(metrics, 'kvyard_shadow_pairs_total{outcome="score_skipped_busy"}') == 1
    assert _metric(metrics, "kvyard_shadow_kl_count") == 0


def test_a_candidate_is_set_and_stopped_at_run_time(make_engine, tokenizer, tiny_path):  # noqa: F811
    """POST /shadow starts mirroring to a candidate without a restart, DELETE /shadow stops it; bad settings are
    a 400 that leaves the current candidate in place."""
    with running_worker(make_engine()) as worker, \
            running_server(make_engine(), served_model_name="candidate") as candidate, \
            running_router(tokenizer, workers=[worker.url], model=str(tiny_path)) as router:
        get = lambda: httpx.get(router.url + "/shadow", timeout=10, trust_env=False)  # noqa: E731
        assert get().status_code == 404
        _ask(router.url, "/v1/completions", {"prompt": "before", "model": str(tiny_path)})  # not mirrored
        set_ = httpx.post(router.url + "/shadow", json={"url": candidate.url, "candidate_model": "candidate",
                                                         "score": 0.0}, timeout=10, trust_env=False)
        assert set_.status_code == 200 and set_.json() == {"url": candidate.url, "candidate_model": "candidate",
                                                           "replaced": False}
        for prompt in ("one", "two"):
            _ask(router.url, "/v1/completions", {"prompt": prompt, "model": str(tiny_path)})
        assert wait_until(lambda: get().json()["summary"].get("requests") == 2, 60)
        summary = get().json()["summary"]
        assert summary["exact_match"] == 1.0 and summary["scored_requests"] == 0  # score 0: compared, not forced
        assert summary["json_valid_primary"] == summary["json_valid_candidate"]
        for bad in ({"url": candidate.url, "sample": 2}, {"sample": 0.5}, {"url": candidate.url, "colour": 1}, [1]):
            r = httpx.post(router.url + "/shadow", json=bad, timeout=10, trust_env=False)
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_shadow", bad
        assert get().json()["summary"]["requests"] == 2  # the candidate is still there
        assert httpx.delete(router.url + "/shadow", timeout=10, trust_env=False).json() == {"stopped": True}
        assert get().status_code == 404
        assert httpx.delete(router.url + "/shadow", timeout=10, trust_env=False).json() == {"stopped": False}
