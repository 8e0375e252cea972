"""The shared-memory collectives: sums and gathers equal to the plain ones, in slot-sized chunks, the same bits
on every rank, and an error (not a hang) when a peer is gone."""

import multiprocessing

import pytest
import torch

from tests.parallel.spawn import spawn_ranks

WAIT_S = 120
WIDTHS = [21, 20, 19]  # each rank's share of the gathered columns


def _rank(rank: int, size: int, port: int, slot_bytes: int, scenario: str, results: "multiprocessing.Queue") -> None:
    from kvyard.parallel.shm import PeerLostError, SharedMemoryGroup

    try:
        group = SharedMemoryGroup(rank, size, f"127.0.0.1:{port}", timeout_s=30, slot_bytes=slot_bytes)
        if scenario == "peer_exits":
            if rank == 1:
                results.put((rank, "left"))
                return  # gone without a word; rank 0's next collective must notice
            try:
                group.all_reduce_(torch.ones(8))
                results.put((rank, "no error"))
            except PeerLostError as e:
                results.put((rank, f"error: {e}"))
            return
        out = {}
        for dtype in (torch.float32, torch.bfloat16):
            # Rank r's values differ from every other rank's, and the tensor spans several slots
            t = (torch.arange(1000, dtype=torch.float32) * (rank + 1) / 7).to(dtype).view(10, 100)
            out[str(dtype)] = {"sum": group.all_reduce_(t.clone()).float().tolist(),
                               "gather": [s.float().tolist() for s in group.all_gather(t[:3])],
                               # unequal widths, a few whole rows a slot (or, in fp32 at 100 wide, a row
                               # larger than a slot)
                               "columns": group.all_gather_columns(t[:, :WIDTHS[rank]].clone(),
                                                                   WIDTHS[:size]).float().tolist(),
                               "wide": group.all_gather_columns(t.clone(), [100] * size).float().tolist()}
        results.put((rank, out))
        group.close()
    except BaseException as e:
        results.put((rank, {"error": repr(e)}))


def _run(size: int, scenario: str, slot_bytes: int = 256) -> dict:
    return spawn_ranks(_rank, size, slot_bytes, scenario, wait_s=WAIT_S)


@pytest.mark.parametrize("size", [2, 3])
def test_sums_and_gathers_match_the_plain_ones_in_chunks(size):
    got = _run(size, "collectives")
    assert not any("error" in g for g in got.values()), got
    for dtype in (torch.float32, torch.bfloat16):
        shares = [(torch.arange(1000, dtype=torch.float32) * (r + 1) / 7).to(dtype).view(10, 100)
                  for r in range(size)]
        want = torch.stack([s.float() for s in shares]).sum(0).to(dtype).float()  # summed in fp32, rounded once
        for rank in range(size):
            ours = got[rank][str(dtype)]
            assert torch.equal(torch.tensor(ours["sum"]), want)
            assert ours["sum"] == got[0][str(dtype)]["sum"]  # the same bits on every rank
            for gathered, share in zip(ours["gather"], shares, strict=True):
                assert torch.equal(torch.tensor(gathered), share[:3].float())
            side_by_side = torch.cat([s[:, :w] for s, w in zip(shares, WIDTHS, strict=False)], dim=-1)
            assert torch.equal(torch.tensor(ours["columns"]), side_by_side.float())
            assert torch.equal(torch.tensor(ours["wide"]), torch.cat(shares, dim=-1).float())


def test_a_peer_that_is_gone_ends_the_collective_with_an_error():
    got = _run(2, "peer_exits")
    assert got[1] == "left"
    assert got[0].startswith("error:") and "is gone" in got[0]
