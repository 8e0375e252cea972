"""QueuedWriter: writes off the caller's thread, and the CPU time they took there."""

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
