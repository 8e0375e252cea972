"""The autoscaling decision (kvyard/cluster/autoscaler.py's ScalePolicy) on signals and a clock of our own."""

from kvyard.cluster.autoscaler import ScalePolicy, Signals
from kvyard.cluster.config import AutoscaleConfig

CONFIG = AutoscaleConfig(min_replicas=1, max_replicas=3, target_waiting=2, max_kv_usage=0.8, ttft_target_s=1.0,
                         up_after_s=3, down_after_s=10, cooldown_s=5)
BUSY = Signals(replicas=2, waiting=5, kv_usage=0.3, in_flight=20)
STEADY = Signals(replicas=2, waiting=0.5, kv_usage=0.3, in_flight=6)
LIGHT = Signals(replicas=2, waiting=0, kv_usage=0.1, in_flight=1)


def run(policy: ScalePolicy, signals: Signals, start: float, end: float, step: float = 1.0) -> list[tuple]:
    """Decisions at each step in [start, end) with the same signals; each change applied at once."""
    out, t = [], start
    while t < end:
        d = policy.decide(signals, t)
        if d.delta:
            out.append((t, d.delta, d.reason))
            policy.changed(t)
        t += step
    return out


def test_an_overload_must_last_before_scaling_up_and_each_signal_counts():
    p = ScalePolicy(CONFIG)
    assert run(p, BUSY, 0, 3) == []  # hysteresis: 3 s of queueing first
    assert run(p, BUSY, 3, 4) == [(3, +1, "queue")]
    for signals, reason in ((Signals(2, 0, 0.9, 10), "kv_cache"), (Signals(2, 0, 0.3, 10, ttft_p50_s=2.5), "ttft")):
        p = ScalePolicy(CONFIG)
        assert run(p, signals, 0, 4) == [(3, +1, reason)]


def test_a_blip_resets_the_wait():
    p = ScalePolicy(CONFIG)
    run(p, BUSY, 0, 2)
    assert run(p, STEADY, 2, 3) == []
    assert run(p, BUSY, 3, 5.5) == []  # the 3 s start again at t=3
    assert run(p, BUSY, 6, 7) == [(6, +1, "queue")]


def test_cooldown_after_a_change_and_never_past_max():
    p = ScalePolicy(CONFIG)
    # The overload still counts during the cooldown, so changes come every 5 s while it lasts.
    assert run(p, BUSY, 0, 20) == [(3, +1, "queue"), (8, +1, "queue"), (13, +1, "queue"), (18, +1, "queue")]
    p = ScalePolicy(CONFIG)
    at_max = Signals(replicas=3, waiting=9, kv_usage=0.9, in_flight=40)
    assert run(p, at_max, 0, 30) == []
    assert p.decide(at_max, 31).reason == "at_max"


def test_light_load_scales_down_slowly_to_the_minimum_and_steady_load_holds():
    p = ScalePolicy(CONFIG)
    assert run(p, LIGHT, 0, 10) == []
    assert run(p, LIGHT, 10, 11) == [(10, -1, "light_load")]
    one = Signals(replicas=1, waiting=0, kv_usage=0.0, in_flight=0)
    assert run(p, one, 11, 60) == []  # at min_replicas
    assert run(ScalePolicy(CONFIG), STEADY, 0, 60) == []  # some queueing and 6 in flight: neither way


def test_requests_in_flight_that_need_every_replica_keep_it():
    p = ScalePolicy(CONFIG, down_load=1.0)
    # 2 requests on 2 replicas: one fewer replica would hold 2 > 1.0 x 1, so nothing is removed.
    assert run(p, Signals(replicas=2, waiting=0, kv_usage=0.1, in_flight=2), 0, 60) == []


def test_out_of_bounds_replica_counts_are_corrected_at_once():
    p = ScalePolicy(CONFIG)
    assert p.decide(Signals(0, 0, 0, 0), 0).delta == +1
    assert p.decide(Signals(4, 0, 0, 0), 0).delta == -1
