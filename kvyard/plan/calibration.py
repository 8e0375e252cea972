"""The costs `kvyard bench plan` fitted on this machine, read back by `kvyard plan --measure` (#38).

The bench appends its fit to a standing record (bench-results/plan/record.jsonl): each layer's cost outside its
matmuls for one process, the same for a rank at its threads and on its code path, and each parallel kind's
sync. A plan on this machine applies the latest of them when the record's CPU is this one; a fit from another
CPU is ignored, since it does not carry over.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path

from kvyard.plan.layouts import Layout
from kvyard.plan.rates import LayerCost

DEFAULT_RECORD = "bench-results/plan/record.jsonl"


def rank_key(threads: int, stack: bool) -> str:
    """How a rank's layer cost is filed: its threads, and whether its layers run in the C++ decode stack."""
    return f"{threads} threads, {'decode stack' if stack else 'layer by layer'}"


@dataclass
class Calibration:
    layer_cost: LayerCost | None = None  # one process, every core
    rank_layer_costs: dict[str, LayerCost] = field(default_factory=dict)  # by rank_key
    syncs: dict[str, float] = field(default_factory=dict)  # SharedCores' tensor_sync_s, stage_sync_s

    def layer_cost_of(self, lo: Layout, threads: int) -> LayerCost | None:
        """The fitted layer cost for a rank of `lo` with `threads` threads (a tensor rank runs layer by layer)."""
        if lo.devices == 1:
            return self.layer_cost
        return self.rank_layer_costs.get(rank_key(threads, lo.tp == 1))


def latest_calibration(path: str | Path, cpu: str | None) -> Calibration | None:
    """The last fit in the record at `path` made on a CPU named `cpu`; None without one."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by an interrupted run
        if entry.get("machine", {}).get("cpu") != cpu or not entry.get("layer_cost"):
            continue
        return Calibration(LayerCost(**entry["layer_cost"]),
                           {k: LayerCost(**v) for k, v in (entry.get("rank_layer_costs") or {}).items()},
                           entry.get("syncs") or {})
    return None
