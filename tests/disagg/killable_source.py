"""A KVSource in a process of its own that serves slowly, for a test to kill mid-transfer.

Prints its endpoint, offers transfers "s" and "t" (blocks 0..3 of make_caches()), then prints "frames"
each time it is about to send data (0.3 s apart) until killed.
"""

import sys
import time

from kvyard.disagg.zmq_transport import KVSource
from tests.disagg.conftest import BLOCK, Offer, make_caches


def main() -> None:
    source = KVSource(make_caches(), BLOCK, mode="layers")

    def slow(frames):
        print("frames", flush=True)
        time.sleep(0.3)
        return frames

    source._tamper = slow
    for tid in ("s", "t"):
        Offer(tid, [0, 1, 2, 3]).offer_to(source, timeout_s=60)
    print(source.endpoint, flush=True)
    time.sleep(60)


if __name__ == "__main__":
    sys.exit(main())
