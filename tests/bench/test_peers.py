"""The HF peer of the offline benchmark, in its own process and in the caller's."""

import pytest
import torch

from kvyard.bench.peers import HFPeer
from kvyard.bench.workload import Workload


@pytest.mark.parametrize("own_process", [True, False])
def test_hf_peer_generates_the_asked_tokens(tiny_checkpoint, own_process):
    peer = HFPeer(tiny_checkpoint("llama"), torch.float32, threads=1, own_process=own_process)
    try:
        work = Workload([[3, 4, 5, 6], [7, 8]], [5, 5])
        assert peer.static_batch(work, pad_id=0) > 0  # it asserts the generated length itself
        assert peer.one_at_a_time(work, pad_id=0) > 0
    finally:
        peer.close()


def test_a_failure_in_the_peer_process_is_raised_here(tiny_checkpoint):
    peer = HFPeer(tiny_checkpoint("llama"), torch.float32, threads=1)
    try:
        with pytest.raises(RuntimeError, match="HF peer process"):
            peer.static_batch(Workload([[]], [3]), pad_id=0)  # an empty prompt: generate refuses it
        assert peer.static_batch(Workload([[3, 4]], [2]), pad_id=0) > 0  # and the process goes on serving
    finally:
        peer.close()
