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

from dataclasses import dataclass, field

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


@dataclass(frozen=True)
class SharedCores:
    """A layout whose ranks are processes sharing one measured machine's cores (kvyard.plan.measure_ranks): a
    rank computes with its share of the threads, so splitting a model across ranks divides no time by them.
    What a step costs is what its ranks were measured to take."""

    # rows -> one rank's matmuls over every layer, at its tensor share and threads, while every rank runs its own
    matmul_s: dict[int, float]
    all_reduce_s: dict[int, float]  # rows -> one all-reduce of [rows, hidden] between the tensor ranks
    gather_s: dict[int, float]  # rows -> the gather of the logits' vocabulary shares
    # rows -> a micro-batch's hidden states handed to the next pipeline stage, and its logits back to the first
    hidden_pipe_s: dict[int, float] = field(default_factory=dict)
    logits_pipe_s: dict[int, float] = field(default_factory=dict)
    # the same while only one stage's ranks run (a pipeline carrying fewer micro-batches than it has stages)
    matmul_alone_s: dict[int, float] = field(default_factory=dict)
    head_s: dict[int, float] = field(default_factory=dict)  # of matmul_s, the LM head's (on the last stage)
    # What a stage step costs beyond its ranks' own work, collectives and hand-overs, each fitted on one measured
    # layout of its kind (`fit_sync`), 0 until then: with tensor ranks, rank 0 sends each step's inputs to its
    # peers and samples while they wait; with stages, each one waits on a pipe and unpickles the step with it.
    tensor_sync_s: float = 0.0
    stage_sync_s: float = 0.0

    def sync_s(self, lo: Layout) -> float:
        """A stage step's sync in `lo`."""
        return (self.tensor_sync_s if lo.tp > 1 else 0.0) + (self.stage_sync_s if lo.pp > 1 else 0.0)

    def collectives_s(self, cfg: ModelConfig, rows: float, gathered_rows: float) -> float:
        """A step's collectives: two all-reduces a layer and the embedding's, and the logits' gather."""
        return (2 * cfg.num_layers + 1) * interpolate(self.all_reduce_s, rows) + \
            interpolate(self.gather_s, gathered_rows)


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
            layer_cost: LayerCost | None = None, prefill_s: dict[int, float] | None = None,
            shared: SharedCores | None = None) -> Rates:
    """Rates of `lo` on `dev` for `batch` sequences at `context` tokens; `params` counts the parameters each
    token computes with (a Mixture of Experts' active ones). `matmul_s` (kvyard.plan.measure.model_matmul_timings,
    rows -> seconds of a forward's matmuls on this machine) replaces the rooflines' matmul terms, split evenly
    across the ranks; `layer_cost` adds each layer's calibrated cost outside them to a decode step. `prefill_s`
    (kvyard.plan.measure.model_prefill_seconds, prompt rows -> seconds of that prefill step on this machine)
    replaces the prefill roofline, split evenly across the ranks. `shared`: the layout's ranks share the
    measured machine's cores; `matmul_s` and `prefill_s` are then what the whole machine takes, and nothing is
    divided by the ranks."""
    peak = _flops(dev, compute)
    ranks = lo.tp * lo.pp
    # The sequences go through the stages as pp micro-batches; each stage step reads the stage's weights once.
    micro = max(batch / lo.pp, 1.0)
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * context  # q.k and p.v, a token
    stage_bytes = memory.weights_read / ranks + micro * context * lo.kv_per_token_per_device
    stage_flops = micro * (2 * params + attention) / ranks
    memory_s = stage_bytes / dev.bandwidth if dev.bandwidth else 0.0
    compute_s = stage_flops / peak if peak else 0.0
    shared = shared if ranks > 1 else None  # one rank has the whole machine: nothing is shared
    if shared:  # each rank's own measured matmuls, at its share of the peak; one memory for all
        attention_s = micro * attention / lo.pp / peak if peak else 0.0
        kv_bytes = micro * context * lo.kv_per_token_per_device * ranks
        if batch < lo.pp and shared.matmul_alone_s:  # one stage at work at a time: each takes its share
            matmuls = interpolate(shared.matmul_alone_s, micro) / lo.pp
        else:  # every stage at work: the last, which holds the head, sets the pace
            head = interpolate(shared.head_s, micro) if shared.head_s and lo.pp > 1 else 0.0
            matmuls = (interpolate(shared.matmul_s, micro) - head) / lo.pp + head
        memory_s = matmuls + kv_bytes / dev.bandwidth + attention_s
        compute_s = 0.0
    elif matmul_s or dev.stream:  # measured: the matmuls' own time at this many rows, then the KV and attention
        matmuls = interpolate(matmul_s, micro) if matmul_s else memory.weights_read / interpolate(dev.stream, micro)
        kv_bytes = micro * context * lo.kv_per_token_per_device
        attention_s = micro * attention / ranks / peak if peak else 0.0
        memory_s, compute_s = matmuls / ranks + kv_bytes / dev.bandwidth + attention_s, 0.0
    if layer_cost:  # a stage's layers, each at its micro-batch's rows
        memory_s += cfg.num_layers / lo.pp * layer_cost.at(micro, cfg.hidden_size)
    comm_s = 0.0
    if shared:
        comm_s = shared.sync_s(lo) + (shared.collectives_s(cfg, micro, micro) / lo.pp if lo.tp > 1 else 0.0)
        if lo.pp > 1:  # a micro-batch's hidden states cross pp - 1 stage boundaries, its logits come back once
            handover = (lo.pp - 1) * interpolate(shared.hidden_pipe_s, micro) + interpolate(shared.logits_pipe_s, micro)
            comm_s += handover / lo.pp
    elif lo.tp > 1 and dev.link:  # two all-reduces of the hidden state a layer (attention's and the MLP's)
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
        if shared:
            prefill = rows / shared_prefill_s(cfg, lo, shared, rows, prefill_s[rows])
    return Rates(step, batch / step if step else 0.0, prefill, bound)


def shared_prefill_s(cfg: ModelConfig, lo: Layout, shared: SharedCores, rows: int, whole_s: float) -> float:
    """Seconds of a prefill step of `rows` that took `whole_s` on the whole machine, run by ranks that share its
    cores. The step splits into pp micro-batches, one a stage at a time: on 1 / ranks of the cores, a stage's
    share of the work takes whole_s / pp, and the last micro-batch leaves the last stage 2 pp - 1 of those
    after the first entered. Tensor ranks add the step's collectives, and each stage its sync."""
    tensor = shared.collectives_s(cfg, rows, 1) if lo.tp > 1 else 0.0
    # every row's hidden states cross each stage boundary (their logits only for the prompts' last rows)
    handover = (lo.pp - 1) * interpolate(shared.hidden_pipe_s, rows) if lo.pp > 1 else 0.0
    return whole_s * (2 * lo.pp - 1) / lo.pp + tensor + handover + lo.pp * shared.sync_s(lo)


def fit_sync(measured_step_s: dict[int, float], predicted_step_s: dict[int, float], pp: int) -> float:
    """The per-stage-step sync that closes the mean gap between one layout's measured and predicted (no sync)
    decode steps; at least 0."""
    gaps = [(measured_step_s[b] - predicted_step_s[b]) / pp for b in measured_step_s]
    return max(0.0, sum(gaps) / len(gaps))


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
