"""Many LoRA adapters in one batch (#39): every loaded adapter in a slot of each layer's stacked weights.

A step's rows may each name a different adapter, or none. For each projection a layer keeps the adapters'
A and B side by side (`StackedLora`), a slot each, as wide as its widest part's rank (the rest zeros: exact).
The decode rows, one a request and each maybe of a different adapter, go through kvyard's BGMV kernel
(kvyard/kernels/csrc/lora.cpp): a row reads only its own adapter's pair, as Punica's BGMV gathers it. A run of
rows with one adapter (a prompt chunk, drafts to verify) takes two small GEMMs with that adapter's pair, as
SGMV's segments do. Rows with no adapter are left out, so a step of base rows alone costs nothing.

The engine fuses q|k|v and gate|up into one matmul each; their adapters' parts sit in the same slot, each B
writing only its part's columns of the fused output.
"""

import dataclasses
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvyard.errors import InvalidRequestError
from kvyard.kernels import cpu as cpu_kernels
from kvyard.lora.adapter import LoraAdapter, load_adapter, module_shape

# The engine's projections and the PEFT modules fused into each, in their output order
PROJECTIONS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
               "down": ("down_proj",)}


@dataclass(frozen=True)
class ServedAdapter:
    """What is known of an adapter served by name, loaded or not: where it is read from, and its content digest
    (the salt of its prefix-cache blocks)."""

    path: str
    digest: str


@dataclass
class LoraRows:
    """A step's rows that run with an adapter: the decode rows (one a request, first in the step) by slot, and
    the longer runs of rows (a prompt chunk, or a decode verifying drafts) as (start, end, slot)."""

    decode_slots: torch.Tensor | None  # [decode rows] int64, each row's slot (-1: the base model); None: no adapter
    segments: list[tuple[int, int, int]]


@dataclass
class StackedLora:
    a: torch.Tensor  # [slots * width, in]
    b: torch.Tensor  # [slots * width, out]
    rank: int  # rows a part takes in a slot: the largest rank of any adapter's part here
    part_offsets: list[int]  # each part's first column in the fused output, then the output's width
    used: torch.Tensor  # [slots, parts] int64: the rows of a part its adapter fills (0: it does not adapt it)

    @property
    def width(self) -> int:  # rows a slot takes
        return self.rank * (len(self.part_offsets) - 1)

    def add_(self, out: torch.Tensor, x: torch.Tensor, rows: LoraRows) -> None:
        """out += each row's own adapter's delta, for the rows that have one."""
        if rows.decode_slots is not None:
            n = rows.decode_slots.shape[0]
            self._gathered_(out[:n], x[:n].contiguous(), rows.decode_slots)
        for start, end, slot in rows.segments:  # a run of rows with one adapter: two small GEMMs
            mine = slice(slot * self.width, (slot + 1) * self.width)
            out[start:end] += (x[start:end] @ self.a[mine].T) @ self.b[mine]

    def _gathered_(self, out: torch.Tensor, x: torch.Tensor, slots: torch.Tensor) -> None:
        """Rows of different adapters: each reads only its own pair (kvyard's BGMV kernel), or, without the
        kernels, every adapter's low-rank columns with the other adapters' zeroed (exact, but it computes them
        all)."""
        if cpu_kernels.available() and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16):
            torch.ops.kvyard.lora_bgmv_(out, x, self.a, self.b, slots, self.rank, self.used, self.part_offsets)
            return
        low = x @ self.a.T
        column_slot = torch.arange(self.a.shape[0], device=x.device) // self.width
        low.mul_(column_slot == slots.unsqueeze(1))
        out += low @ self.b


def stack_projection(adapters: list[LoraAdapter], layer: int, projection: str, cfg, dtype: torch.dtype,
                     device: torch.device) -> StackedLora | None:
    """The adapters' pairs for one projection of one layer, a slot each in list order; None if none adapts it."""
    parts = PROJECTIONS[projection]
    rank = max((a.modules[(layer, p)].rank for a in adapters for p in parts if (layer, p) in a.modules), default=0)
    if rank == 0:
        return None
    shapes = [module_shape(cfg, p) for p in parts]
    offsets = [sum(out for out, _ in shapes[:i]) for i in range(len(parts) + 1)]
    width = rank * len(parts)
    a = torch.zeros(len(adapters) * width, shapes[0][1])
    b = torch.zeros(len(adapters) * width, offsets[-1])
    used = torch.zeros(len(adapters), len(parts), dtype=torch.long)
    for slot, adapter in enumerate(adapters):
        for i, part in enumerate(parts):
            module = adapter.modules.get((layer, part))
            if module is not None:
                first = slot * width + i * rank
                a[first : first + module.rank] = module.a
                b[first : first + module.rank, offsets[i] : offsets[i + 1]] = module.b.T
                used[slot, i] = module.rank
    return StackedLora(a.to(dtype=dtype, device=device), b.to(dtype=dtype, device=device), rank, offsets,
                       used.to(device))


class LoraRegistry:
    """The adapters a model serves, by name. Those loaded take a slot of every layer's stacks
    (`LayerWeights.lora`); with a memory budget, the least recently used one no request is running with makes way
    for one a request names, and is read again from its directory when a request names it."""

    def __init__(self, model, memory_budget: int = 0,  # type: ignore[no-untyped-def]
                 busy: Callable[[str], bool] = lambda name: False) -> None:
        self.model = model
        self.memory_budget = memory_budget  # bytes of stacked weights the loaded adapters may take; 0: no limit
        self.busy = busy  # whether a request is running with the adapter of this name
        self.served: dict[str, ServedAdapter] = {}  # every adapter served, loaded or not
        self.adapters: OrderedDict[str, LoraAdapter] = OrderedDict()  # the loaded, least recently used first
        self.slots: list[str] = []  # the loaded by slot, as stacked (use reorders `adapters`, never the stacks)
        self.loads = 0  # adapters read from disk, first loads and reloads after an eviction

    def load(self, name: str, path: str) -> LoraAdapter:
        """Read the adapter at `path` and serve it as `name` (replacing any adapter of that name)."""
        return self.serve(name, path, load_adapter(name, path, self.model.cfg))

    def serve(self, name: str, path: str, adapter: LoraAdapter) -> LoraAdapter:
        """Serve `adapter`, read from `path`, as `name` (replacing any adapter of that name)."""
        self.adapters.pop(name, None)
        self._admit(adapter)
        self.served[name] = ServedAdapter(path, adapter.digest)
        return adapter

    def acquire(self, name: str) -> LoraAdapter:
        """The adapter `name`, loaded (again, if it was evicted) and marked the most recently used."""
        if name not in self.served:
            served = ", ".join(sorted(self.served)) or "none"
            raise InvalidRequestError(f"unknown LoRA adapter {name!r} (served: {served})", param="model")
        if name in self.adapters:
            self.adapters.move_to_end(name)
            return self.adapters[name]
        adapter = load_adapter(name, self.served[name].path, self.model.cfg)
        self._admit(adapter)
        return adapter

    def rename(self, old: str, new: str) -> None:
        """Serve the adapter `old` as `new`, in the same slot (its stacks stay as they are)."""
        self.served[new] = self.served.pop(old)
        self.adapters = OrderedDict((new if n == old else n, dataclasses.replace(a, name=new) if n == old else a)
                                    for n, a in self.adapters.items())
        self.slots = [new if n == old else n for n in self.slots]

    def unload(self, name: str) -> None:
        if name not in self.served:
            self.acquire(name)  # the unknown adapter's error
        del self.served[name]
        if self.adapters.pop(name, None) is not None:
            self._restack()

    def adapter_bytes(self, adapter: LoraAdapter) -> int:
        """What the adapter takes once stacked in the model's dtype."""
        return adapter.nbytes // 4 * self.model.dtype.itemsize

    def _admit(self, adapter: LoraAdapter) -> None:
        need = self.adapter_bytes(adapter)
        if self.memory_budget:
            if need > self.memory_budget:
                raise InvalidRequestError(f"LoRA adapter {adapter.name!r} takes {need} bytes, more than the whole "
                                          f"LoRA memory budget ({self.memory_budget})", param="model")
            held = sum(self.adapter_bytes(a) for a in self.adapters.values())
            for name in [n for n in self.adapters if not self.busy(n)]:  # least recently used first
                if held + need <= self.memory_budget:
                    break
                held -= self.adapter_bytes(self.adapters.pop(name))
            if held + need > self.memory_budget:
                raise InvalidRequestError(f"no room for LoRA adapter {adapter.name!r}: the adapters requests are "
                                          f"running with fill the LoRA memory budget; retry later", param="model")
        self.adapters[adapter.name] = adapter
        self.loads += 1
        self._restack()

    def rows(self, runs: list[tuple[int, int, str | None]], num_decodes: int, device: torch.device
             ) -> LoraRows | None:
        """A step's rows' adapters from its runs of rows (start, count, adapter name or None), the first
        `num_decodes` of them single decode rows; None when no row has an adapter."""
        slot_of = {name: i for i, name in enumerate(self.slots)}
        decodes = [slot_of[name] if name is not None else -1 for _, _, name in runs[:num_decodes]]
        segments = [(start, start + n, slot_of[name]) for start, n, name in runs[num_decodes:] if name is not None]
        if not segments and all(s < 0 for s in decodes):
            return None
        has_decode = any(s >= 0 for s in decodes)
        return LoraRows(torch.tensor(decodes, device=device) if has_decode else None, segments)

    def _restack(self) -> None:
        model, adapters = self.model, list(self.adapters.values())
        self.slots = list(self.adapters)
        for i, layer in zip(model.layer_indices(), model.layers, strict=True):
            stacks = {p: stack_projection(adapters, i, p, model.cfg, model.dtype, model.device) for p in PROJECTIONS}
            layer.lora = {p: s for p, s in stacks.items() if s is not None} or None
