from kvyard.spec.adaptive import AdaptiveK


def test_k_falls_with_rejections_and_recovers_with_acceptance():
    a = AdaptiveK(k_max=4)
    assert a.k_for("r") == 4
    for _ in range(10):
        a.observe("r", 4, 0)
    assert a.k_for("r") == 0
    for _ in range(10):
        a.observe("r", 1, 1)
    assert a.k_for("r") == 4


def test_k_zero_still_probes_now_and_then():
    a = AdaptiveK(k_max=3, probe_every=4)
    for _ in range(20):
        a.observe("r", 3, 0)
    ks = [a.k_for("r") for _ in range(8)]
    assert ks.count(1) == 2 and ks.count(0) == 6


def test_partial_acceptance_gives_a_middle_k_and_fixed_mode_ignores_it():
    a = AdaptiveK(k_max=8)
    for _ in range(30):
        a.observe("r", 4, 1)  # one of two tested drafts accepted: acceptance 0.5
    assert abs(a.acceptance("r") - 0.5) < 0.01
    assert a.k_for("r") == 2  # 0.5**2 >= 0.15 > 0.5**3
    fixed = AdaptiveK(k_max=5, adaptive=False)
    fixed.observe("r", 5, 0)
    assert fixed.k_for("r") == 5


def test_retain_forgets_other_requests():
    a = AdaptiveK(k_max=4)
    a.observe("a", 4, 0)
    a.observe("b", 4, 0)
    a.retain({"b"})
    assert a.acceptance("a") == a.prior and a.acceptance("b") < a.prior
