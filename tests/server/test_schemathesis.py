"""Schema-driven fuzzing: schemathesis generates requests from the server's own /openapi.json, valid
ones and ones that break the schema, and sends them to a live loopback server on a tiny random model.

Whatever it sends, the server must answer with something other than a 5xx, must not hide a server
error in a stream, and must still be healthy at the end. Most fuzzed bodies fail validation early
(an empty prompt, a message without content), so a third pass pins the prompt or the conversation to a
valid one and fuzzes everything else: those requests reach the engine with every sampling parameter
the schema allows. Bounded: a few dozen examples per operation and pass, derandomized (CI sees the same
requests every run), and a wall-clock budget. KVYARD_FUZZ_EXAMPLES raises the count for a longer run.
"""

import json
import os
import time

import httpx
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode

from tests.server.harness import running_server

EXAMPLES = int(os.environ.get("KVYARD_FUZZ_EXAMPLES", "40"))
BUDGET_S = 45.0
# A valid prompt per generation route, for the pass that fuzzes everything but the prompt.
PINNED = {
    "/v1/completions": {"prompt": "The quick brown fox"},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Say something."}]},
}


def _stream_errors(text: str) -> list[dict]:
    errors = []
    for line in text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            event = json.loads(line[len("data: "):])
            if isinstance(event, dict) and "error" in event:
                errors.append(event["error"])
    return errors


def _pin(case: schemathesis.Case, fields: dict) -> schemathesis.Case:
    if isinstance(case.body, dict):
        case.body.update(fields)
    return case


def fuzz_operation(op: schemathesis.APIOperation, mode: GenerationMode, base_url: str, deadline: float,
                   pinned: dict | None = None) -> int:
    """Send up to EXAMPLES generated requests to one operation; the number actually sent."""
    sent = 0
    strategy = op.as_strategy(generation_mode=mode)
    if pinned:
        strategy = strategy.map(lambda case: _pin(case, pinned))

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def fuzz(case: schemathesis.Case) -> None:
        nonlocal sent
        if time.monotonic() > deadline:
            return  # out of budget: the remaining examples pass without a request
        response = case.call(base_url=base_url, timeout=30)
        sent += 1
        what = f"{case.method} {case.path} body={case.body!r}"
        assert response.status_code < 500, f"{what} -> {response.status_code} {response.text[:500]}"
        if "text/event-stream" in str(response.headers.get("content-type")):
            errors = _stream_errors(response.text)
            assert not [e for e in errors if e.get("type") == "server_error"], f"{what} -> {errors}"

    fuzz()
    return sent


def test_fuzzed_requests_never_get_a_server_error(make_engine):
    # A short context bounds every generation, whatever max_tokens, n and prompts the fuzzer picks.
    engine = make_engine(max_model_len=48)
    deadline = time.monotonic() + BUDGET_S
    sent: dict[str, int] = {}
    with running_server(engine, request_timeout=60, max_queue=None) as srv:
        schema = schemathesis.openapi.from_url(srv.url + "/openapi.json")
        operations = [result.ok() for result in schema.get_all_operations()]
        assert {op.label for op in operations} >= {"POST /v1/completions", "POST /v1/chat/completions"}
        for op in operations:
            # A request without input has nothing to break: only valid ones for it.
            modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if len(op.body) else [])
            for mode in modes:
                sent[op.label] = sent.get(op.label, 0) + fuzz_operation(op, mode, srv.url, deadline)
            if op.path in PINNED:
                pinned = fuzz_operation(op, GenerationMode.POSITIVE, srv.url, deadline, PINNED[op.path])
                sent[op.label] += pinned
        health = httpx.get(srv.url + "/health", timeout=10)
    assert health.status_code == 200 and engine.is_running
    assert sent["POST /v1/completions"] >= 10 and sent["POST /v1/chat/completions"] >= 10, sent
