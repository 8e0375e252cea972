"""The offload tiers in the router's index: a worker's own tiers, a Redis tier shared by replicas, and the
credits that weigh a tier's blocks against the pool's when placing a request."""

import random

from kvyard.router.config import RouterSettings
from kvyard.router.placement import route_request
from kvyard.router.policies import Candidate, KVPolicy
from kvyard.router.prefix_index import PrefixIndex, leading_overlap
from kvyard.router.worker import Worker

H = [bytes([i]) * 32 for i in range(8)]
SHARED = "redis:0123456789ab"


def _credit(idx: PrefixIndex):
    return lambda w, h: 1.0 if idx.holds(w, h) else idx.tiers.credit(w, h)


def test_a_prefix_spanning_the_pool_and_a_tier_counts_each_block_at_its_tiers_credit():
    idx = PrefixIndex()
    idx.add("a", H[:2])
    idx.tiers.add("a", "host", H[2:4])
    idx.tiers.add("a", "disk", H[4:5])
    idx.tiers.set_credits("a", {"host": 0.75, "disk": 0.25})
    assert leading_overlap(H[:6], ["a", "b"], _credit(idx)) == {"a": 2 + 2 * 0.75 + 0.25, "b": 0.0}
    idx.tiers.set_credits("a", {"host": 0.75, "disk": 0.0})  # measured slower than recomputing: worth nothing
    assert leading_overlap(H[:6], ["a"], _credit(idx)) == {"a": 3.5}
    idx.tiers.remove("a", "host", [H[3]])
    assert leading_overlap(H[:6], ["a"], _credit(idx)) == {"a": 2.75}  # a gap ends the run
    idx.replace("a", [], {"host": [H[0]]})  # a resync: the pool's and its own tiers' blocks from the snapshot
    assert leading_overlap(H[:6], ["a"], _credit(idx)) == {"a": 0.75}
    idx.drop("a")
    assert idx.tiers.num_blocks("a") == {} and idx.tiers.credit("a", H[0]) == 0.0


def test_a_shared_tier_one_replica_wrote_is_credited_to_every_replica_that_reads_it():
    idx = PrefixIndex()
    idx.tiers.add("a", SHARED, H[:3])  # a wrote them
    idx.tiers.set_credits("a", {SHARED: 0.5})
    idx.tiers.set_credits("b", {SHARED: 0.25})  # b reads the same tier, and measured it slower
    idx.tiers.set_credits("c", {})  # c has no tiers
    assert leading_overlap(H[:3], ["a", "b", "c"], _credit(idx)) == {"a": 1.5, "b": 0.75, "c": 0.0}
    idx.drop("a")  # a's writes stay in Redis for b
    assert idx.tiers.credit("b", H[2]) == 0.25
    idx.tiers.remove("b", SHARED, [H[0]])  # found gone by one replica: gone for all
    assert idx.tiers.credit("b", H[0]) == 0.0
    small = PrefixIndex()
    small.tiers.shared_limit = 2
    small.tiers.add("a", SHARED, H[:3])
    small.tiers.set_credits("a", {SHARED: 1.0})
    assert [small.tiers.credit("a", h) for h in H[:3]] == [0.0, 1.0, 1.0]  # only the most recent are kept


def test_the_kv_policy_prefers_a_replica_that_can_load_the_prefix_over_one_that_must_recompute_it():
    a, b, c = (Worker(f"http://w{i}") for i in range(3))
    policy = KVPolicy(RouterSettings(prefill_weight=1.0, load_weight=0.1, hot_spot_factor=10), random.Random(0))
    req = route_request(list(range(161)), 16)  # 10 matchable blocks
    pick, reason = policy.choose(req, [Candidate(a, 0.0), Candidate(b, 10 * 0.25), Candidate(c, 0.0)])
    assert pick.worker is b and reason == "affinity"
    pick, _ = policy.choose(req, [Candidate(a, 10.0), Candidate(b, 10 * 0.25)])
    assert pick.worker is a  # the pool's blocks beat a tier's
