"""The comparator: an identical candidate scores KL 0 and exact matches; a degraded one is flagged, its worst
requests first; tool calls agree on parsed arguments."""

import math

import pytest

from kvyard.shadow.compare import Answer, Budgets, coarse_kl, score_pair, verdict


def _dist(probs: dict[int, float]) -> dict[int, float]:
    return {t: math.log(p) for t, p in probs.items()}


def test_identical_distributions_have_no_divergence_and_others_some():
    p = _dist({1: 0.6, 2: 0.3, 3: 0.05})
    assert coarse_kl(p, p) == 0.0
    q = _dist({1: 0.3, 2: 0.6, 3: 0.05})
    want = 0.6 * math.log(0.6 / 0.3) + 0.3 * math.log(0.3 / 0.6)  # token 3 and the rest (0.05) cancel
    assert coarse_kl(p, q) == pytest.approx(want, abs=1e-12)
    # a token the candidate does not list counts at its least listed logprob: a lower bound of the true KL
    assert coarse_kl(p, _dist({1: 0.6, 2: 0.3})) >= 0.0


def test_an_identical_candidate_passes_and_a_degraded_one_is_flagged_worst_first():
    dists = [_dist({5: 0.9, 6: 0.05}), _dist({7: 0.7, 8: 0.2})]
    primary = Answer("the answer", ttft_s=0.10, itl_s=[0.01, 0.01], dists=dists)
    same = [score_pair(f"r{i}", primary, Answer("the answer", 0.10, [0.01, 0.01], dists)) for i in range(5)]
    v = verdict(same, Budgets())
    assert v.passed and v.summary["kl_mean"] == 0.0 and v.summary["exact_match"] == 1.0
    assert v.summary["top1_agreement"] == 1.0
    worse = Answer("an answer", ttft_s=0.30, itl_s=[0.02, 0.02], dists=[_dist({5: 0.2, 6: 0.7}), dists[1]])
    scores = same[:4] + [score_pair("bad", primary, worse)]
    v = verdict(scores, Budgets())
    assert not v.passed and v.worst[0].request_id == "bad"
    assert any(f.startswith("exact_match 0.8") for f in v.failures) and any("kl_mean" in f for f in v.failures)
    bad = v.worst[0]
    assert bad.top1_agreement == 0.5 and bad.ttft_delta_s == pytest.approx(0.2) and bad.itl_delta_s == pytest.approx(0.01)


def test_json_and_tool_calls_are_compared_as_parsed():
    call = {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}
    respaced = {"name": "get_weather", "arguments": '{"unit":"celsius","city":"Oslo"}'}
    other = {"name": "get_weather", "arguments": '{"city": "Lima"}'}
    s = score_pair("t", Answer('{"a": 1}', tool_calls=[call]), Answer("not json", tool_calls=[respaced]))
    assert s.json_valid == (True, False) and s.tools_agree is True
    assert score_pair("t", Answer("", tool_calls=[call]), Answer("", tool_calls=[other])).tools_agree is False
    assert score_pair("t", Answer("x"), Answer("x")).tools_agree is None


def test_nothing_compared_is_no_pass():
    v = verdict([], Budgets())
    assert not v.passed and v.failures == ["no request was compared"]
