"""The stacked adapters' deltas: kvyard's BGMV kernel, the plain-PyTorch fallback and a row-by-row reference agree,
for decode rows of mixed adapters (and none) and for runs of rows with one adapter."""

import pytest
import torch

from kvyard.kernels import cpu as cpu_kernels
from kvyard.lora.stack import LoraRows, StackedLora

# a fused q|k|v of 24, 8 and 8 columns; and of widths in 16s, which the kernel's AVX-512 bf16 path takes
OFFSETS = ([0, 24, 32, 40], [0, 32, 48, 64])
RANK, SLOTS, IN = 4, 3, 32


def _stack(dtype: torch.dtype, offsets: list[int]) -> StackedLora:
    g = torch.Generator().manual_seed(0)
    width = RANK * (len(offsets) - 1)
    a = torch.randn(SLOTS * width, IN, generator=g)
    b = torch.zeros(SLOTS * width, offsets[-1])
    for row in range(SLOTS * width):
        part = row % width // RANK
        b[row, offsets[part] : offsets[part + 1]] = torch.randn(offsets[part + 1] - offsets[part], generator=g)
    used = torch.full((SLOTS, len(offsets) - 1), RANK)
    a[width + RANK - 1] = 0  # slot 1's q part has rank 3: its padded row is zero, as stack_projection leaves it
    b[width + RANK - 1] = 0
    used[1, 0] = RANK - 1
    a[2 * width + RANK : 2 * width + 2 * RANK] = 0  # slot 2 does not adapt k
    b[2 * width + RANK : 2 * width + 2 * RANK] = 0
    used[2, 1] = 0
    return StackedLora(a.to(dtype), b.to(dtype), RANK, offsets, used)


def _reference(stack: StackedLora, x: torch.Tensor, slots: list[int]) -> torch.Tensor:
    out = torch.zeros(x.shape[0], stack.part_offsets[-1])
    for i, s in enumerate(slots):
        if s >= 0:
            mine = slice(s * stack.width, (s + 1) * stack.width)
            out[i] = (x[i].float() @ stack.a[mine].float().T) @ stack.b[mine].float()
    return out


@pytest.mark.parametrize("offsets", OFFSETS)
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("kernels", [True, False])
def test_deltas_agree_with_a_row_by_row_reference(monkeypatch, dtype, tol, kernels, offsets):
    if kernels and not cpu_kernels.available():
        pytest.skip("kvyard's CPU kernels do not build here")
    monkeypatch.setattr(cpu_kernels, "available", lambda: kernels)
    stack = _stack(dtype, offsets)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, IN, generator=g).to(dtype)
    base = torch.randn(9, offsets[-1], generator=g).to(dtype)
    decode_slots = [2, -1, 0, 1, 1]  # five decode rows, one of them the base model's
    rows = LoraRows(torch.tensor(decode_slots), [(5, 8, 1)])  # then rows 5-7 one adapter's, row 8 the base's
    out = base.clone()
    stack.add_(out, x, rows)
    want = base.float() + _reference(stack, x, [*decode_slots, 1, 1, 1, -1])
    assert torch.allclose(out.float(), want, atol=tol, rtol=tol)
    assert torch.equal(out[1], base[1]) and torch.equal(out[8], base[8])  # base rows untouched
