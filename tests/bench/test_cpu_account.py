import ctypes
import threading
import time

from kvyard.bench import cpu_account

PR_SET_NAME = 15


def _spin(name: bytes, seconds: float, release: threading.Event) -> None:
    # The kernel's name for this thread, as Ray's C++ threads set theirs.
    ctypes.CDLL(None).prctl(PR_SET_NAME, ctypes.c_char_p(name), 0, 0, 0)
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass
    release.wait(10)  # stay in /proc until the second snapshot: an ended thread's time is not counted


def test_threads_are_told_apart_by_their_names():
    release = threading.Event()
    before, t0 = cpu_account.snapshot(), time.monotonic()
    threads = [threading.Thread(target=_spin, args=(name, 0.3, release)) for name in (b"worker.io", b"kvyard-test")]
    for t in threads:
        t.start()
    while time.monotonic() - t0 < 10 and sum(v.seconds for v in _mine().values()) < 0.6:
        time.sleep(0.05)
    got = cpu_account.account(before, cpu_account.snapshot(), time.monotonic() - t0)
    release.set()
    for t in threads:
        t.join()
    assert got["ray_threads_cpu_s"] >= 0.25
    assert got["serving_cpu_s"] >= 0.25
    assert 0 < got["ray_threads_cpu_share"] <= 1


def _mine() -> dict:
    import os

    return {k: v for k, v in cpu_account.snapshot().items() if k[0] == os.getpid()}


def test_daemons_are_known_by_their_command_line():
    assert cpu_account._kind("/venv/lib/ray/core/src/ray/gcs/gcs_server --port 1", "gcs_server") == "ray_daemons"
    assert cpu_account._kind("ray::ReplicaActor.run_until_stopped", "worker.io") == "ray_threads"
    assert cpu_account._kind("ray::ReplicaActor.run_until_stopped", "ray::ReplicaAct") == "serving"
