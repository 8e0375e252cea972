import glob
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import zmq

from kvyard.disagg import wire
from kvyard.disagg.layout import KVLayout
from kvyard.disagg.payload import KVTransferError
from kvyard.disagg.zmq_transport import KVFetcher
from tests.disagg.conftest import BLOCK, Offer, make_caches, wait_until

ROOT = Path(__file__).resolve().parents[2]


def test_a_source_killed_mid_transfer_fails_the_fetch_at_once_and_leaks_no_segment():
    proc = subprocess.Popen([sys.executable, "-m", "tests.disagg.killable_source"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        endpoint = proc.stdout.readline().strip()
        assert endpoint.startswith("tcp://"), endpoint
        layout, offer = KVLayout.of(make_caches(), BLOCK), Offer("t", [0, 1, 2, 3])
        segments = f"/dev/shm/kvyard-kv-{proc.pid}-*"
        with zmq.Context() as ctx:  # a same-host fetcher takes transfer "s" by shared memory, never acks
            sock = ctx.socket(zmq.DEALER)
            sock.connect(endpoint)
            sock.send(wire.encode(wire.Fetch("s", layout, wire.host_id(), shm=True, lease_s=60)))
            assert proc.stdout.readline().strip() == "frames" and sock.poll(10_000)
            assert wire.decode_reply(sock.recv()).mode == "shm"
            sock.close(linger=0)
        assert len(glob.glob(segments)) == 1
        errors: list[BaseException] = []

        def pull() -> None:
            with KVFetcher(allow_shm=False) as fetcher, pytest.raises(KVTransferError) as e:
                fetcher.fetch(endpoint, "t", layout, offer.hashes, timeout_s=30)
            errors.append(e.value)

        puller = threading.Thread(target=pull)
        puller.start()
        assert proc.stdout.readline().strip() == "frames"  # transfer "t" is under way, layer by layer
        proc.kill()
        killed = time.monotonic()
        puller.join(timeout=30)
        assert not puller.is_alive() and len(errors) == 1
        assert "disconnected" in str(errors[0])
        assert time.monotonic() - killed < 5  # not the 30 s timeout
        # the dead source's segment is unlinked by multiprocessing's resource tracker
        assert wait_until(lambda: glob.glob(segments) == [], timeout_s=10)
    finally:
        proc.kill()
        proc.wait()
