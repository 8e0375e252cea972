"""Disaggregated serving end to end through the router with the `openai` client: long prompts are prefilled
on the prefill worker and decoded on the decode worker, short ones stay local, the answers equal colocated
serving's, and a dead prefill worker only turns prefill local."""

import httpx
from openai import OpenAI

from tests.router.harness import running_router, running_worker
from tests.server.harness import wait_until

MODEL = "tiny"  # every worker serves it under this name (served_model_name)
SYSTEM = "You are a careful assistant. Paged attention keeps the KV cache in fixed-size blocks. " * 2


def metric(url: str, name: str, labels: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10, trust_env=False).text
    for line in text.splitlines():
        if line.startswith(f"{name}{{{labels}}}"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def chat(client: OpenAI, question: str, stream: bool) -> str:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    kwargs = dict(model=MODEL, messages=messages, max_tokens=8, temperature=0.0,
                  extra_body={"ignore_eos": True})
    if not stream:
        return client.chat.completions.create(**kwargs).choices[0].message.content or ""
    chunks = client.chat.completions.create(stream=True, **kwargs)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_router_prefills_remotely_decodes_locally_and_survives_a_dead_prefill_worker(make_engine, tokenizer):
    reference = make_engine(block_size=4)
    with (running_worker(make_engine(block_size=4), role="prefill", kv_transfer_port=0,
                         served_model_name=MODEL) as p,
          running_worker(make_engine(block_size=4), role="decode", served_model_name=MODEL) as d,
          running_worker(reference, served_model_name=MODEL) as ref,
          running_router(tokenizer, workers=[p.url, d.url], disagg_threshold=24) as router):
        assert wait_until(lambda: all(w["status"] == "healthy" for w in router.workers().values()))
        assert {w["role"] for w in router.workers().values()} == {"prefill", "decode"}
        client = OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)
        direct = OpenAI(base_url=ref.url + "/v1", api_key="x", max_retries=0)
        for i, stream in enumerate((False, True)):
            question = f"Question {i}: what does a block table hold?"
            assert chat(client, question, stream) == chat(direct, question, stream=False)
        assert metric(router.url, "kvyard_router_disagg_decisions_total", 'decision="remote"') == 2
        assert metric(d.url, "kvyard_kv_pulls_total", 'outcome="ok"') == 2
        # Nothing reached the prefill worker's generation endpoints; it only prefilled.
        assert metric(p.url, "kvyard_kv_prefills_total", 'outcome="offered"') == 2
        assert metric(p.url, "kvyard_requests_total", 'outcome="length"') == 0

        short = client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, temperature=0.0)
        assert short.choices[0].text is not None
        assert metric(router.url, "kvyard_router_disagg_decisions_total", 'decision="short"') == 1

        p.server.should_exit = True  # the prefill worker goes away: prefill turns local, requests complete
        assert wait_until(lambda: router.workers()[p.url]["status"] == "dead", timeout=15)
        question = "After the prefill worker died?"
        assert chat(client, question, stream=False) == chat(direct, question, stream=False)
