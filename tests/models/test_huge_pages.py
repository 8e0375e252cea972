"""Weights moved onto huge pages keep their values, shapes, views and sharing, and land on huge pages."""

import re
from pathlib import Path

import pytest
import torch

from kvyard.loader.checkpoint import load_checkpoint
from kvyard.models.decoder import DecoderModel
from kvyard.models.huge_pages import HUGE_PAGE, enabled, move_to_huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_grants_madvised_pages() -> bool:
    return THP.exists() and re.search(r"\[(always|madvise)\]", THP.read_text()) is not None


def _mapping_of(address: int) -> tuple[str, int]:
    """(header line, AnonHugePages in kB) of the mapping holding `address`, from /proc/self/smaps."""
    header, huge = "", 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            if header:
                break
            if int(head[1], 16) <= address < int(head[2], 16):
                header = line
        elif header and line.startswith("AnonHugePages:"):
            huge = int(line.split()[1])
    return header, huge


@pytest.mark.skipif(not enabled(), reason="huge pages are Linux-only here")
def test_values_views_and_shared_storage_survive_the_move():
    base = torch.randn(64, 32)
    view = base[8:16]  # a view into the same storage
    tied = base  # the same object twice (a tied head)
    other = torch.arange(10, dtype=torch.int8)
    expected = [base.clone(), view.clone(), other.clone()]
    before = base.data_ptr()
    moved = move_to_huge_pages([base, view, tied, other])
    assert moved >= base.nbytes + other.nbytes
    assert base.data_ptr() != before
    assert view.data_ptr() == base.data_ptr() + 8 * 32 * 4  # still a view, at the same place in it
    for t, e in zip([base, view, other], expected, strict=True):
        assert torch.equal(t, e)
    base[8, 0] = 123.0  # and still shares its storage
    assert view[0, 0].item() == 123.0


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("KVYARD_HUGE_PAGES", "0")
    t = torch.randn(4, 4)
    before = t.data_ptr()
    assert move_to_huge_pages([t]) == 0 and t.data_ptr() == before


@pytest.mark.skipif(not (enabled() and _thp_grants_madvised_pages()), reason="transparent huge pages are off here")
def test_a_large_weight_lands_on_huge_pages():
    t = torch.randn(4 * HUGE_PAGE // 4)  # 8 MB
    move_to_huge_pages([t])
    assert _mapping_of(t.data_ptr())[1] >= HUGE_PAGE // 1024


@pytest.mark.skipif(not enabled(), reason="huge pages are Linux-only here")
def test_a_loaded_model_holds_every_weight_in_one_arena(tiny_checkpoint):
    ckpt = load_checkpoint(tiny_checkpoint("llama"))
    model = DecoderModel(ckpt.config, torch.float32, torch.device("cpu"), max_positions=64)
    model.load(ckpt.tensors(), "tiny")
    tensors = list(model.weight_tensors())
    assert len(tensors) >= 3 + 6 * ckpt.config.num_layers
    mappings = {_mapping_of(t.data_ptr())[0] for t in tensors}
    assert len(mappings) == 1 and "[heap]" not in mappings.pop()  # one anonymous mapping, not malloc's heap
