"""Many LoRA adapters in one batch (#39): every loaded adapter in a slot of each layer's stacked weights.

A step's rows may each name a different adapter, or none. For each projection a layer keeps the adapters'
A and B side by side (`StackedLora`), so the rows that have an adapter take their deltas in two dense matmuls
whatever their mix, as Punica's BGMV gathers each row's pair: x @ A.T gives every adapter's low-rank
activations, the columns not of a row's own adapter are zeroed, and @ B adds the row's delta. A slot is as
wide as its widest part's rank, the others padded with zeros (exact: a zero column adds nothing). Rows with no
adapter are left out of both matmuls, so a step of base rows alone costs nothing.

The engine fuses q|k|v and gate|up into one matmul each; their adapters' parts sit in the same slot, each B
writing only its part's columns of the fused output.
"""

from dataclasses import dataclass

import torch

from kvyard.errors import InvalidRequestError
from kvyard.lora.adapter import LoraAdapter, load_adapter, module_shape

# The engine's projections and the PEFT modules fused into each, in their output order
PROJECTIONS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
               "down": ("down_proj",)}


@dataclass
class LoraRows:
    """Which rows of a step have an adapter, and whose: `index` of those rows (None: every row), `slots` theirs."""

    index: torch.Tensor | None
    slots: torch.Tensor  # [rows with an adapter], int64


@dataclass
class StackedLora:
    a: torch.Tensor  # [slots * width, in]
    b: torch.Tensor  # [slots * width, out]
    column_slot: torch.Tensor  # [slots * width]: the slot each low-rank column belongs to

    def add_(self, out: torch.Tensor, x: torch.Tensor, rows: LoraRows) -> None:
        """out += each row's own adapter's delta, for the rows that have one."""
        xs = x if rows.index is None else x.index_select(0, rows.index)
        low = xs @ self.a.T
        low.mul_(self.column_slot == rows.slots.unsqueeze(1))
        delta = low @ self.b
        if rows.index is None:
            out.add_(delta)
        else:
            out.index_add_(0, rows.index, delta)


def stack_projection(adapters: list[LoraAdapter], layer: int, projection: str, cfg, dtype: torch.dtype,
                     device: torch.device) -> StackedLora | None:
    """The adapters' pairs for one projection of one layer, a slot each in list order; None if none adapts it."""
    parts = PROJECTIONS[projection]
    rank = max((a.modules[(layer, p)].rank for a in adapters for p in parts if (layer, p) in a.modules), default=0)
    if rank == 0:
        return None
    shapes = [module_shape(cfg, p) for p in parts]
    width = rank * len(parts)
    a = torch.zeros(len(adapters) * width, shapes[0][1])
    b = torch.zeros(len(adapters) * width, sum(out for out, _ in shapes))
    for slot, adapter in enumerate(adapters):
        out_start = 0
        for i, (part, (out, _)) in enumerate(zip(parts, shapes, strict=True)):
            module = adapter.modules.get((layer, part))
            if module is not None:
                first = slot * width + i * rank
                a[first : first + module.rank] = module.a
                b[first : first + module.rank, out_start : out_start + out] = module.b.T
            out_start += out
    column_slot = torch.arange(len(adapters) * width, device=device) // width
    return StackedLora(a.to(dtype=dtype, device=device), b.to(dtype=dtype, device=device), column_slot)


class LoraRegistry:
    """The adapters a model serves, by name; each a slot of every layer's stacks (`LayerWeights.lora`)."""

    def __init__(self, model) -> None:  # type: ignore[no-untyped-def]
        self.model = model
        self.adapters: dict[str, LoraAdapter] = {}

    def load(self, name: str, path: str) -> LoraAdapter:
        """Read the adapter at `path` and serve it as `name` (replacing any adapter of that name)."""
        adapter = load_adapter(name, path, self.model.cfg)
        self.adapters[name] = adapter
        self._restack()
        return adapter

    def unload(self, name: str) -> None:
        self.adapter(name)
        del self.adapters[name]
        self._restack()

    def adapter(self, name: str) -> LoraAdapter:
        if name not in self.adapters:
            known = ", ".join(sorted(self.adapters)) or "none loaded"
            raise InvalidRequestError(f"unknown LoRA adapter {name!r} (loaded: {known})", param="model")
        return self.adapters[name]

    def rows(self, names: list[str | None], device: torch.device) -> LoraRows | None:
        """A step's rows' adapters, by name (None: the base model); None when no row has one."""
        slot_of = {name: i for i, name in enumerate(self.adapters)}
        slots = [slot_of[n] if n is not None else -1 for n in names]
        index = [i for i, s in enumerate(slots) if s >= 0]
        if not index:
            return None
        if len(index) == len(slots):
            return LoraRows(None, torch.tensor(slots, device=device))
        return LoraRows(torch.tensor(index, device=device), torch.tensor([slots[i] for i in index], device=device))

    def _restack(self) -> None:
        model, adapters = self.model, list(self.adapters.values())
        for i, layer in zip(model.layer_indices(), model.layers, strict=True):
            stacks = {p: stack_projection(adapters, i, p, model.cfg, model.dtype, model.device) for p in PROJECTIONS}
            layer.lora = {p: s for p, s in stacks.items() if s is not None} or None
