"""QueuedWriter: writes off the caller's thread, and the CPU time they took there."""

import threading
import time

import torch

from kvyard.offload.writer import QueuedWriter


def test_the_writer_thread_counts_the_cpu_its_writes_took_and_not_its_waits():
    def write(h: bytes, tokens: tuple[int, ...], block: torch.Tensor) -> None:
        if h == b"busy":
            end = time.thread_time() + 0.05
            while time.thread_time() < end:
                pass
        else:
            time.sleep(0.2)  # waiting (on a socket, a disk) is not CPU

    writer = QueuedWriter(write, "test", 4, on_error=lambda e: None)
    assert writer.submit(b"busy", (1,), torch.zeros(1)) and writer.submit(b"idle", (2,), torch.zeros(1))
    writer.flush()
    assert 0.05 <= writer.cpu_s < 0.15 and not writer.pending
    writer.close()


def test_writes_queued_behind_a_busy_one_go_out_together_and_a_failed_batch_leaves_nothing_pending():
    gate, batches, errors = threading.Event(), [], []

    def write_many(writes: list) -> None:
        gate.wait(5)
        batches.append([h for h, _, _ in writes])
        if b"bad" in batches[-1]:
            raise OSError("gone")

    writer = QueuedWriter(None, "test", 8, on_error=errors.append, write_many=write_many)
    assert writer.submit(b"a", (1,), torch.zeros(1))
    deadline = time.monotonic() + 5
    while writer._worker._queue.qsize() and time.monotonic() < deadline:  # the thread has taken "a" and waits
        time.sleep(0.01)
    for h in (b"b", b"c", b"bad"):
        assert writer.submit(h, (2,), torch.zeros(1))
    assert writer.queued(b"c") is not None
    gate.set()
    writer.flush()
    assert batches == [[b"a"], [b"b", b"c", b"bad"]]
    assert len(errors) == 1 and isinstance(errors[0], OSError) and not writer.pending
    writer.close()
