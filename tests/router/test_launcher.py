"""`kvyard up`'s worker environment: workers that share cores get libgomp's short spin, others keep its default."""

import pytest

from kvyard.router.launcher import SHARED_CORES_SPIN_COUNT, ClusterSpec


@pytest.fixture(autouse=True)
def four_cores(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)


def test_prefill_and_decode_workers_share_the_cores_and_spin_briefly():
    spec = ClusterSpec(replicas=2, model="m", roles=["prefill", "decode"])
    assert spec.threads() == 4
    assert spec.worker_env()["GOMP_SPINCOUNT"] == str(SHARED_CORES_SPIN_COUNT)


def test_replicas_on_their_own_cores_keep_the_default_spin():
    spec = ClusterSpec(replicas=2, model="m")
    assert spec.threads() == 2
    assert "GOMP_SPINCOUNT" not in spec.worker_env()
    assert "GOMP_SPINCOUNT" in ClusterSpec(replicas=2, model="m", num_threads=3).worker_env()


def test_a_spin_setting_of_the_users_is_kept(monkeypatch):
    monkeypatch.setenv("GOMP_SPINCOUNT", "5000")
    assert ClusterSpec(replicas=2, model="m", roles=["prefill", "decode"]).worker_env()["GOMP_SPINCOUNT"] == "5000"
    monkeypatch.delenv("GOMP_SPINCOUNT")
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert "GOMP_SPINCOUNT" not in ClusterSpec(replicas=2, model="m", roles=["prefill", "decode"]).worker_env()
