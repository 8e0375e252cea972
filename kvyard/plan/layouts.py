"""Which tensor × pipeline parallel layouts hold a model on a device, and the KV headroom each leaves (#38).

A layout of tp × pp devices splits the weights (kvyard splits every matrix, the vocabulary rows included,
across tensor ranks, and the layers across stages; the first stage holds the embedding, the last the head).
The KV splits by KV head across tensor ranks (replicated when there are fewer KV heads than ranks, and always
for a latent cache, which every rank reads whole) and by layer across stages. Each device keeps `utilization`
of its memory for kvyard, and every rank pays one step's activations. On one host (this machine) the ranks
share its memory as they share its cores.
"""

import math
from dataclasses import dataclass

from kvyard.models.config import ModelConfig
from kvyard.plan.hardware import Device
from kvyard.plan.memory import MemoryBreakdown


@dataclass
class Layout:
    tp: int
    pp: int
    weights_per_device: float  # on the device that holds the most
    kv_per_token_per_device: float
    headroom_per_device: float  # bytes left for KV after weights and activations
    stage_weights: tuple[float, ...] = ()  # a device of each pipeline stage, first to last

    @property
    def devices(self) -> int:
        return self.tp * self.pp

    @property
    def fits(self) -> bool:
        return self.headroom_per_device > 0

    @property
    def kv_tokens(self) -> int:
        """Tokens of KV the layout can hold (over every sequence)."""
        return max(0, int(self.headroom_per_device // self.kv_per_token_per_device))


def tensor_sizes(cfg: ModelConfig, most: int) -> list[int]:
    """The tensor-parallel sizes kvyard allows: the attention heads split evenly (and the KV heads, or a KV
    head shared by whole groups of ranks)."""
    def ok(tp: int) -> bool:
        heads, kv = cfg.num_heads, cfg.num_kv_heads
        return heads % tp == 0 and (cfg.is_mla or kv % tp == 0 or tp % kv == 0)
    return [tp for tp in range(1, most + 1) if ok(tp)]


def stage_weights(cfg: ModelConfig, memory: MemoryBreakdown, tp: int, pp: int) -> tuple[float, ...]:
    """A device's weights in each of pp stages: its share of the layers, the embedding on the first stage and the
    head on the last (a tied head the embedding again, once they are on different stages); split across the
    tensor ranks but for the norms, which each holds whole."""
    split = (memory.weights - memory.embedding - memory.head - memory.norms) / pp / tp
    layers = split + (memory.norms - memory.final_norm) / pp
    if pp == 1:
        return (layers + memory.final_norm + (memory.embedding + memory.head) / tp,)
    last = layers + memory.final_norm + (memory.head + (memory.embedding if cfg.tie_word_embeddings else 0.0)) / tp
    return (layers + memory.embedding / tp, *[layers] * (pp - 2), last)


def layout(cfg: ModelConfig, memory: MemoryBreakdown, dev: Device, tp: int, pp: int, utilization: float) -> Layout:
    kv_split = 1 if cfg.is_mla else min(tp, cfg.num_kv_heads)
    kv_per_device = memory.kv_per_token / kv_split / pp
    usable = dev.memory_bytes * utilization / (tp * pp if dev.one_host else 1)  # one host: the ranks share it
    stages = stage_weights(cfg, memory, tp, pp)
    return Layout(tp, pp, max(stages), kv_per_device, usable - max(stages) - memory.activations, stages)


def layouts(cfg: ModelConfig, memory: MemoryBreakdown, dev: Device, max_devices: int,
            utilization: float) -> list[Layout]:
    """Every tp × pp up to `max_devices` (pp up to the layer count), the fitting ones first, fewest devices then
    most KV headroom."""
    out = [layout(cfg, memory, dev, tp, pp, utilization)
           for tp in tensor_sizes(cfg, max_devices)
           for pp in range(1, min(max_devices // tp, cfg.num_layers) + 1)]
    return sorted(out, key=lambda lo: (not lo.fits, lo.devices, -lo.kv_tokens, lo.pp))


def devices_by_memory(memory: MemoryBreakdown, dev: Device, utilization: float) -> int:
    """The fewest devices whose memory holds the weights, the target KV and the activations, ignoring how
    they would be split."""
    room = dev.memory_bytes * utilization - memory.activations
    return math.ceil((memory.weights + memory.kv_total) / room) if room > 0 else 0  # 0: not even one step fits
