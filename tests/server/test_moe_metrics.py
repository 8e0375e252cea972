"""An MoE model's routing in /metrics: tokens per expert (every forwarded token counted top-k times in each sparse
layer) and the imbalance across experts."""

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvyard.server.async_engine import AsyncEngine
from tests.server.conftest import tiny_engine_config
from tests.server.harness import running_server, wait_until


def _routing(url: str) -> tuple[dict[str, float], float | None]:
    tokens, imbalance = {}, None
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", trust_env=False).text):
        for sample in family.samples:
            if sample.name == "kvyard_moe_expert_tokens_total":
                tokens[sample.labels["expert"]] = sample.value
            elif sample.name == "kvyard_moe_imbalance":
                imbalance = sample.value
    return tokens, imbalance


def test_routed_tokens_and_imbalance_reach_the_metrics(tiny_checkpoint):
    # qwen2_moe in small: 2 layers, the first dense (mlp_only_layers), 4 experts, top-2
    engine = AsyncEngine.from_config(tiny_engine_config(tiny_checkpoint("qwen2_moe")))
    try:
        with running_server(engine) as server:
            before, _ = _routing(server.url)  # start-up calibration passes are routed too
            r = httpx.post(server.url + "/v1/completions", trust_env=False, timeout=60, json={
                "prompt": [5, 6, 7, 8, 9, 10], "max_tokens": 8, "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            # 6 prompt tokens and 7 decoded ones (the 8th is sampled, never forwarded), 2 experts each, 1 layer
            expected = sum(before.values()) + (6 + 7) * 2
            assert wait_until(lambda: sum(_routing(server.url)[0].values()) == expected)
            tokens, imbalance = _routing(server.url)
            assert sorted(tokens) == ["0", "1", "2", "3"] and imbalance is not None and 1.0 <= imbalance <= 4.0
    finally:
        engine.shutdown()


def test_expert_parallel_ranks_loads_reach_the_metrics(tiny_checkpoint):
    """Experts round-robin over 2 ranks (0 and 2 on rank 0, 1 and 3 on rank 1): each rank's load is its experts'."""
    engine = AsyncEngine.from_config(tiny_engine_config(tiny_checkpoint("qwen2_moe"), tensor_parallel_size=2,
                                                        enable_expert_parallel=True, expert_placement="round_robin"))
    try:
        with running_server(engine) as server:
            r = httpx.post(server.url + "/v1/completions", trust_env=False, timeout=60, json={
                "prompt": [5, 6, 7, 8, 9, 10], "max_tokens": 8, "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            tokens, ranks = {}, {}
            for family in text_string_to_metric_families(httpx.get(server.url + "/metrics", trust_env=False).text):
                for sample in family.samples:
                    if sample.name == "kvyard_moe_expert_tokens_total":
                        tokens[sample.labels["expert"]] = sample.value
                    elif sample.name == "kvyard_moe_rank_tokens_total":
                        ranks[sample.labels["rank"]] = sample.value
            assert sum(tokens.values()) > 0
            assert ranks == {"0": tokens["0"] + tokens["2"], "1": tokens["1"] + tokens["3"]}
    finally:
        engine.shutdown()
