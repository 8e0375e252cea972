"""`kvyard lora promote`: a trained adapter is shadowed against what a served name does now, on live traffic
through the router, and takes the name only when the stated bars hold; either way the shadow and the candidate
are gone afterwards."""

import httpx
import pytest

from kvyard import LLM, SamplingParams
from kvyard.bench.lora_loop import BackgroundTraffic
from kvyard.cli.main import main
from kvyard.errors import ConfigError
from kvyard.lora.promote import Bar
from tests.lora.adapters import make_adapter
from tests.router.conftest import make_engine, tiny_path, tokenizer  # noqa: F401 - the router tests' fixtures
from tests.router.harness import running_router, running_worker

PROMPT = "The quick brown fox"


def _ask(url: str, model: str) -> str:
    r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 6,
                                                  "temperature": 0, "ignore_eos": True}, timeout=60, trust_env=False)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def adapter(tiny_path, tmp_path_factory):  # noqa: F811
    return make_adapter(tiny_path, tmp_path_factory.mktemp("promote") / "adapter", seed=3)


def _models(url: str) -> set[str]:
    return {m["id"] for m in httpx.get(url + "/v1/models", timeout=10, trust_env=False).json()["data"]}


@pytest.mark.parametrize("passes", [True, False], ids=["promoted", "held-back"])
def test_an_adapter_takes_the_name_only_when_the_bars_hold(make_engine, tokenizer, tiny_path, adapter, tmp_path,  # noqa: F811
                                                           passes):
    # The tiny model never answers in JSON: a bar on JSON answers fails, one on differing from the base holds
    bars = ["exact_match<=0.5"] + ([] if passes else ["json_valid_candidate>=0.5"])
    base = str(tiny_path)
    with running_worker(make_engine(), enable_lora_runtime_updates=True) as worker, \
            running_router(tokenizer, workers=[worker.url], model=base) as router, \
            BackgroundTraffic(router.url, base, [PROMPT], max_tokens=6) as traffic:
        code = main(["lora", "promote", "--router", router.url, "--name", "task", "--adapter", str(adapter),
                     "--primary", base, "--pairs", "4", "--timeout", "60",
                     *[arg for bar in bars for arg in ("--bar", bar)], "--json-out", str(tmp_path / "r.json")])
        models = _models(worker.url)
        served = _ask(router.url, "task") if passes else None
        shadow = httpx.get(router.url + "/shadow", timeout=10, trust_env=False).status_code
    assert traffic.sent >= 4
    assert code == (0 if passes else 1)
    assert "task-candidate" not in models and shadow == 404  # cleaned up either way
    assert ("task" in models) == passes
    if passes:
        offline = LLM(base, dtype="float32", lora_adapters={"task": str(adapter)})
        greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        assert served == offline.generate([PROMPT], greedy, lora="task")[0].outputs[0].text


def test_bars_are_parsed_and_checked():
    bar = Bar.parse("json_gain >= 0.1")
    assert (bar.metric, bar.op, bar.value, str(bar)) == ("json_gain", ">=", 0.1, "json_gain>=0.1")
    assert bar.holds({"json_gain": 0.1}) and not bar.holds({"json_gain": 0.05}) and not bar.holds({})
    assert Bar.parse("kl_mean<=1e-3").holds({"kl_mean": 5e-4})
    for bad in ("json_gain > 0.1", "json_gain>=x", "=0.1"):
        with pytest.raises(ConfigError, match="METRIC>=VALUE"):
            Bar.parse(bad)
