"""The prefix index, predicted state and the policies, without any server."""

import random

from kvyard.engine.block_manager import block_hashes
from kvyard.router.config import RouterSettings
from kvyard.router.placement import route_request
from kvyard.router.policies import Candidate, KVPolicy, LeastLoaded, RoundRobin, hot_spot_filter, make_policy
from kvyard.router.predicted import PredictedCache
from kvyard.router.prefix_index import PrefixIndex, leading_overlap
from kvyard.router.worker import Worker

H = [bytes([i]) * 32 for i in range(8)]


def test_index_tracks_each_worker_and_overlap_is_a_leading_run():
    idx = PrefixIndex()
    idx.add("a", H[:4])
    idx.add("b", [H[0], H[2]])
    assert leading_overlap(H[:4], ["a", "b", "c"], idx.holds) == {"a": 4, "b": 1, "c": 0}
    idx.remove("a", [H[1]])
    assert leading_overlap(H[:4], ["a"], idx.holds) == {"a": 1}  # a gap ends the usable prefix
    idx.replace("b", H[5:7])
    assert not idx.holds("b", H[0]) and idx.holds("b", H[6]) and idx.num_blocks("b") == 2
    idx.drop("a")
    assert idx.num_blocks("a") == 0 and not idx.holds("a", H[0])
    assert idx.holds("b", H[5])


def test_predictions_expire_after_their_ttl():
    now = [0.0]
    pred = PredictedCache(ttl=5.0, clock=lambda: now[0])
    pred.add("a", H[:2])
    assert pred.holds("a", H[1]) and not pred.holds("b", H[1])
    now[0] = 5.1
    assert not pred.holds("a", H[1]) and pred.size("a") == 0


def test_route_request_counts_matchable_blocks_like_the_engine():
    req = route_request(list(range(33)), 16)
    assert req.hashes == block_hashes(list(range(33)), 16) and len(req.hashes) == 2
    assert req.matchable == 2 and req.num_blocks == 3
    assert route_request(list(range(32)), 16).matchable == 1  # the last token is always recomputed
    assert route_request(None, 16).hashes == []


def workers(n: int) -> list[Worker]:
    return [Worker(f"http://w{i}") for i in range(n)]


def test_kv_policy_prefers_the_cached_prefix_until_load_outweighs_it():
    a, b = workers(2)
    policy = KVPolicy(
        RouterSettings(prefill_weight=1.0, load_weight=0.5, hot_spot_factor=10), random.Random(0)
    )
    req = route_request(list(range(161)), 16)  # 11 blocks, 10 matchable
    pick, reason = policy.choose(req, [Candidate(a, 8), Candidate(b, 0)])
    assert pick.worker is a and reason == "affinity"
    a.in_flight_blocks = 40  # 0.5 * 40 = 20 > 8 blocks saved
    assert policy.choose(req, [Candidate(a, 8), Candidate(b, 0)])[0].worker is b


def test_hot_spot_protection_spreads_a_popular_prefix():
    ws = workers(4)
    settings = RouterSettings(hot_spot_factor=1.5, hot_spot_slack=1.0, load_weight=0.0)
    policy = KVPolicy(settings, random.Random(0))
    req = route_request(list(range(300)), 16)
    for _ in range(40):  # everyone wants w0 (it holds the whole prefix); nobody finishes
        cands = [Candidate(w, 18 if w is ws[0] else 0) for w in ws]
        pick, _ = policy.choose(req, cands)
        pick.worker.in_flight += 1
    loads = [w.in_flight for w in ws]
    assert max(loads) <= 1.5 * 40 / 4 + 1 and min(loads) > 0, loads
    assert hot_spot_filter([Candidate(w, 0) for w in ws], 1.5, 1.0)  # never empty


def test_softmax_temperature_sometimes_explores():
    a, b = workers(2)
    policy = KVPolicy(RouterSettings(temperature=1.0, hot_spot_factor=10), random.Random(1))
    req = route_request(list(range(161)), 16)
    picks = {policy.choose(req, [Candidate(a, 10), Candidate(b, 0)])[0].worker.url for _ in range(50)}
    assert picks == {a.url, b.url}
    greedy = KVPolicy(RouterSettings(temperature=0.0, hot_spot_factor=10), random.Random(1))
    assert {greedy.choose(req, [Candidate(a, 10), Candidate(b, 0)])[0].worker.url for _ in range(20)} == {
        a.url
    }


def test_baselines():
    ws = workers(3)
    req = route_request(list(range(40)), 16)
    rr = RoundRobin()
    assert [rr.choose(req, [Candidate(w, 0) for w in ws])[0].worker.url for _ in range(6)] == [
        w.url for w in ws
    ] * 2
    ws[0].in_flight, ws[1].in_flight, ws[2].in_flight = 3, 1, 1
    ll = LeastLoaded()
    picks = {ll.choose(req, [Candidate(w, 5) for w in ws])[0].worker.url for _ in range(4)}
    assert picks == {ws[1].url, ws[2].url}  # the two least loaded, taking turns
    assert make_policy(RouterSettings(policy="random", seed=3)).name == "random"
