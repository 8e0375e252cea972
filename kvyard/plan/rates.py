"""Predicted decode and prefill rates of a layout: rooflines, communication and queueing (#38).

A decode step of `batch` sequences at `context` tokens reads every weight once and each sequence's KV, and
does 2 FLOPs per parameter per sequence (plus attention's 4 per cached token and head dimension): its time
on a device is the larger of bytes / bandwidth and FLOPs / peak, the two rooflines. Tensor parallelism
divides both across ranks and adds two all-reduces of the hidden state a layer, priced at the link's
bandwidth (a ring moves 2 (tp - 1) / tp of the data) plus a fixed latency each. Pipeline stages hold a
layer share each and the sequences pass through them as pp micro-batches, so in a memory-bound step every
micro-batch reads its stage's weights again: stages add room, and spread only the KV reads. On a measured
CPU the matmuls' time comes from the model's own matmuls timed at its shapes (`matmul_s`), or else from the
rate the engine's kernels streamed weights at that many rows (`Device.stream`); either folds in how well they
overlap reading and computing, and the KV reads and attention are added to it. What a layer costs outside
its matmuls (`LayerCost`) is fitted on one measured model and added per layer; the catalogue's devices have
none until they are measured. A measured prefill step (`prefill_s`) is the engine's own layers timed over a
step of prompts, since a prefill layer's attention and elementwise work do not follow a decode step's fit.

Near saturation requests wait: an M/M/1 queue in front of a server that decodes at the predicted rate waits
ρ / (1 - ρ) service times, where ρ is the offered load over capacity.
"""

from dataclasses import dataclass

from kvyard.models.config import ModelConfig
from kvyard.plan.hardware import Device
from kvyard.plan.layouts import Layout
from kvyard.plan.memory import MemoryBreakdown

LINK_LATENCY_S = 5e-6  # one all-reduce's fixed cost on NVLink-class links


@dataclass(frozen=True)
class LayerCost:
    """What a layer's step costs outside its matmuls on a measured machine: attention's kernel, norms, rotary,
    activations, residuals and the Python between them. A fixed part and a part that grows with the rows and
    the hidden size (elementwise work), fitted on one model's measured steps (`fit_layer_cost`)."""

    fixed_s: float
    per_row_hidden_s: float

    def at(self, rows: float, hidden: int) -> float:
        return self.fixed_s + self.per_row_hidden_s * rows * hidden


def fit_layer_cost(cfg: ModelConfig, predicted_s: dict[int, float], measured_s: dict[int, float]) -> LayerCost:
    """The LayerCost that closes the gap between a model's predicted and measured decode steps at two row
    counts (the fewest and the most given); each part at least 0."""
    lo, hi = min(measured_s), max(measured_s)
    rest = {r: max(0.0, measured_s[r] - predicted_s[r]) / cfg.num_layers for r in (lo, hi)}
    slope = max(0.0, (rest[hi] - rest[lo]) / ((hi - lo) * cfg.hidden_size))
    return LayerCost(max(0.0, rest[lo] - slope * lo * cfg.hidden_size), slope)


@dataclass
class Rates:
    decode_step_s: float
    decode_tok_s: float  # all sequences together
    prefill_tok_s: float
    bound: str  # what limits decode: "memory", "compute" or "communication"


def _flops(dev: Device, compute: str) -> float:
    return dev.flops.get(compute) or dev.flops.get("bfloat16") or 0.0


def predict(cfg: ModelConfig, params: int, memory: MemoryBreakdown, dev: Device, lo: Layout, batch: int,
            context: int, compute: str = "bfloat16", activation_bytes: int = 2, matmul_s: dict[int, float] | None = None,
            layer_cost: LayerCost | None = None, prefill_s: dict[int, float] | None = None) -> Rates:
    """Rates of `lo` on `dev` for `batch` sequences at `context` tokens; `params` counts the parameters each
    token computes with (a Mixture of Experts' active ones). `matmul_s` (kvyard.plan.measure.model_matmul_timings,
    rows -> seconds of a forward's matmuls on this machine) replaces the rooflines' matmul terms, split evenly
    across the ranks; `layer_cost` adds each layer's calibrated cost outside them to a decode step. `prefill_s`
    (kvyard.plan.measure.model_prefill_seconds, prompt rows -> seconds of that prefill step on this machine)
    replaces the prefill roofline, split evenly across the ranks."""
    peak = _flops(dev, compute)
    ranks = lo.tp * lo.pp
    # The sequences go through the stages as pp micro-batches; each stage step reads the stage's weights once.
    micro = max(batch / lo.pp, 1.0)
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * context  # q.k and p.v, a token
    stage_bytes = memory.weights_read / ranks + micro * context * lo.kv_per_token_per_device
    stage_flops = micro * (2 * params + attention) / ranks
    memory_s = stage_bytes / dev.bandwidth if dev.bandwidth else 0.0
    compute_s = stage_flops / peak if peak else 0.0
    if matmul_s or dev.stream:  # measured: the matmuls' own time at this many rows, then the KV and attention
        matmuls = interpolate(matmul_s, micro) if matmul_s else memory.weights_read / interpolate(dev.stream, micro)
        kv_bytes = micro * context * lo.kv_per_token_per_device
        attention_s = micro * attention / ranks / peak if peak else 0.0
        memory_s, compute_s = matmuls / ranks + kv_bytes / dev.bandwidth + attention_s, 0.0
    if layer_cost:  # a stage's layers, each at its micro-batch's rows
        memory_s += cfg.num_layers / lo.pp * layer_cost.at(micro, cfg.hidden_size)
    comm_s = 0.0
    if lo.tp > 1 and dev.link:  # two all-reduces of the hidden state a layer (attention's and the MLP's)
        moved = 2 * (lo.tp - 1) / lo.tp * micro * cfg.hidden_size * activation_bytes
        comm_s = 2 * (moved / dev.link + LINK_LATENCY_S) * cfg.num_layers / lo.pp
    # A sequence's next token waits for every stage: pp stage steps.
    step = lo.pp * (max(memory_s, compute_s) + comm_s)
    bound = ("communication" if comm_s > max(memory_s, compute_s) else
             "memory" if memory_s >= compute_s else "compute")
    # Prefill is compute-bound; the head runs for the last prompt token only, and attention over half the context.
    per_token = 2 * (params - cfg.vocab_size * cfg.hidden_size) + attention / 2
    prefill = peak * ranks / per_token if peak else 0.0
    if prefill_s:
        rows = max(prefill_s)
        prefill = ranks * rows / prefill_s[rows]
    return Rates(step, batch / step if step else 0.0, prefill, bound)


def interpolate(measured: dict[int, float], rows: float) -> float:
    """A figure measured at some row counts, at `rows`: linear between them (flat past their ends)."""
    points = sorted(measured.items())
    if rows <= points[0][0]:
        return points[0][1]
    for (r0, v0), (r1, v1) in zip(points, points[1:], strict=False):
        if rows <= r1:
            return v0 + (v1 - v0) * (rows - r0) / (r1 - r0)
    return points[-1][1]


def queueing_wait_s(service_s: float, offered: float, capacity: float) -> float:
    """Mean wait before service in an M/M/1 queue at `offered` requests/s against `capacity` requests/s
    (infinite at or past saturation)."""
    rho = offered / capacity
    return float("inf") if rho >= 1 else service_s * rho / (1 - rho)
