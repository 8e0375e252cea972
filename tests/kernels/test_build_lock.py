"""A build lock that a killed kernel build left behind is cleared, so later loads do not wait on it forever."""

import os
import time

from kvyard.kernels.cpu import clear_stale_lock


def test_an_old_lock_is_removed_and_a_fresh_one_kept(tmp_path):
    lock = tmp_path / "lock"
    lock.touch()
    assert not clear_stale_lock(tmp_path, max_age_s=60) and lock.exists()  # a build may be running
    old = time.time() - 120
    os.utime(lock, (old, old))
    assert clear_stale_lock(tmp_path, max_age_s=60) and not lock.exists()
    assert not clear_stale_lock(tmp_path, max_age_s=60)  # nothing left to clear
