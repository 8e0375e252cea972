"""Tensor parallelism (Megatron-LM's layout): each rank of a group holds a slice of every layer's weights.

- q, k, v: column-parallel, sharded by heads. With fewer KV heads than ranks, each KV head is replicated on
  the ranks whose query heads use it (rank r holds KV head r * kv_heads // ranks).
- o_proj and down_proj: row-parallel; each rank's product is a partial sum, all-reduced before the residual add.
- gate|up: column-parallel, by the intermediate dimension.
- The embedding and LM head: vocabulary-parallel. Rank r holds rows vocab_range(r) of each; a token's embedding
  comes from the rank that holds its row (the others add zeros, all-reduced), and the logits' slices are
  all-gathered. The norms are whole on every rank.

A rank's model is the family's own decoder built for the rank's share (heads, KV heads, intermediate size
divided by the ranks), loading a checkpoint whose tensors `shard_tensor` slices by their global HF names, so one
loader serves every layout. Its KV cache holds only the rank's KV heads.
"""

import re
from collections.abc import Iterable, Iterator
from dataclasses import replace
from typing import Protocol

import torch
import torch.nn.functional as F

from kvyard.errors import ConfigError
from kvyard.models.config import ModelConfig
from kvyard.models.decoder import DecoderModel, LayerWeights
from kvyard.models.kv_layer import LayerKV
from kvyard.quant.qtensor import QuantizedTensor

# Families whose layers are the plain decoder's (MoE, latent attention and Gemma's sandwich norms come later)
TP_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

_LAYER = r"model\.layers\.\d+\."
_COLUMN_HEADS = re.compile(_LAYER + r"self_attn\.q_proj\.(weight|bias)$")
_COLUMN_KV_HEADS = re.compile(_LAYER + r"self_attn\.[kv]_proj\.(weight|bias)$")
_ROW_HEADS = re.compile(_LAYER + r"self_attn\.o_proj\.weight$")
_COLUMN_FFN = re.compile(_LAYER + r"mlp\.(gate|up)_proj\.weight$")
_ROW_FFN = re.compile(_LAYER + r"mlp\.down_proj\.weight$")
_VOCAB = re.compile(r"(model\.embed_tokens|lm_head)\.weight$")


class Collective(Protocol):
    """The group's communication: rank, size, and an in-place sum across ranks."""

    rank: int
    size: int

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor: ...

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `t` (the same shape on each), in rank order, on every rank."""
        ...


def valid_tensor_parallel_sizes(cfg: ModelConfig, most: int = 64) -> list[int]:
    return [n for n in range(1, most + 1) if _divides(cfg, n)]


def _divides(cfg: ModelConfig, ranks: int) -> bool:
    kv = cfg.num_kv_heads
    kv_ok = kv % ranks == 0 or (ranks % kv == 0 and cfg.num_heads // ranks * ranks == cfg.num_heads)
    return cfg.num_heads % ranks == 0 and kv_ok and cfg.intermediate_size % ranks == 0


def check_tensor_parallel(cfg: ModelConfig, ranks: int) -> None:
    """A clear error for a model this many ranks cannot split, naming the sizes that would work."""
    if cfg.model_type not in TP_MODEL_TYPES:
        raise ConfigError(f"tensor parallelism supports {', '.join(TP_MODEL_TYPES)} for now, not {cfg.model_type}",
                          param="tensor_parallel_size")
    if ranks < 1 or not _divides(cfg, ranks):
        raise ConfigError(
            f"tensor_parallel_size {ranks} does not divide this model ({cfg.num_heads} attention heads, "
            f"{cfg.num_kv_heads} KV heads, intermediate size {cfg.intermediate_size}); sizes that do: "
            f"{', '.join(map(str, valid_tensor_parallel_sizes(cfg)))}", param="tensor_parallel_size")


def local_config(cfg: ModelConfig, ranks: int) -> ModelConfig:
    """The model as one rank of `ranks` sees it: its share of the heads, KV heads and intermediate size."""
    check_tensor_parallel(cfg, ranks)
    return replace(cfg, num_heads=cfg.num_heads // ranks, num_kv_heads=max(1, cfg.num_kv_heads // ranks),
                   intermediate_size=cfg.intermediate_size // ranks)


def vocab_range(vocab_size: int, rank: int, ranks: int) -> tuple[int, int]:
    """The rows [start, stop) of the embedding and LM head that rank `rank` holds: near-equal shares, the
    first `vocab_size % ranks` ranks one row more (a vocabulary need not divide by the ranks)."""
    share, extra = divmod(vocab_size, ranks)
    start = rank * share + min(rank, extra)
    return start, start + share + (rank < extra)


def kv_head_of(cfg: ModelConfig, rank: int, ranks: int) -> int:
    """With fewer KV heads than ranks: the one KV head rank `rank` holds (its query heads' group)."""
    return rank * cfg.num_kv_heads // ranks


def shard_tensor(name: str, t: torch.Tensor, cfg: ModelConfig, rank: int, ranks: int) -> torch.Tensor:
    """Rank `rank`'s slice of the checkpoint tensor `name` (global HF names; whole where it is replicated)."""
    if ranks == 1:
        return t
    d = cfg.head_dim
    if _COLUMN_HEADS.match(name):
        return _chunk(t, 0, rank, ranks)
    if _COLUMN_KV_HEADS.match(name):
        if cfg.num_kv_heads >= ranks:
            return _chunk(t, 0, rank, ranks)
        head = kv_head_of(cfg, rank, ranks)
        return t[head * d : (head + 1) * d].contiguous()
    if _ROW_HEADS.match(name) or _ROW_FFN.match(name):
        return _chunk(t, 1, rank, ranks)
    if _COLUMN_FFN.match(name):
        return _chunk(t, 0, rank, ranks)
    if _VOCAB.match(name):
        start, stop = vocab_range(cfg.vocab_size, rank, ranks)
        return t[start:stop].contiguous()
    return t


def _chunk(t: torch.Tensor, dim: int, rank: int, ranks: int) -> torch.Tensor:
    return t.chunk(ranks, dim)[rank].contiguous()


def shard_stream(tensors: Iterable[tuple[str, torch.Tensor | QuantizedTensor]], cfg: ModelConfig, rank: int,
                 ranks: int) -> Iterator[tuple[str, torch.Tensor]]:
    for name, t in tensors:
        if isinstance(t, QuantizedTensor):
            raise ConfigError(f"{name}: tensor parallelism shards dense weights only for now (this checkpoint's "
                              "layers are low-bit); load it without --quantization, or with tensor_parallel_size 1",
                              param="tensor_parallel_size")
        yield name, shard_tensor(name, t, cfg, rank, ranks)


class TensorParallelDecoder(DecoderModel):
    """One rank's share of a plain decoder: its attention and MLP outputs are partial sums, all-reduced."""

    def __init__(self, cfg: ModelConfig, group: Collective, dtype: torch.dtype, device: torch.device,
                 max_positions: int, max_rows: int | None = None):
        self.full_config = cfg
        self.group = group
        self.vocab_range = vocab_range(cfg.vocab_size, group.rank, group.size)
        self.vocab_shares = [stop - start for start, stop in
                             (vocab_range(cfg.vocab_size, r, group.size) for r in range(group.size))]
        self.vocab_share = self.vocab_shares[0]  # the largest: every rank's logits are padded to it to gather
        start, stop = self.vocab_range
        share = replace(local_config(cfg, group.size), vocab_size=stop - start)
        super().__init__(share, dtype, device, max_positions, max_rows)

    def load(self, tensors: Iterable[tuple[str, torch.Tensor | QuantizedTensor]], source: str) -> None:
        full = self.full_config
        super().load(shard_stream(tensors, full, self.group.rank, self.group.size), source)

    def _decode_stack(self) -> torch.ScriptObject | None:
        return None  # the C++ stack runs every layer at once, with no all-reduce between them

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        start, stop = self.vocab_range
        mine = (input_ids >= start) & (input_ids < stop)
        rows = F.embedding((input_ids - start).clamp_(0, stop - start - 1), self.embed)
        # Exactly one rank holds each token's row and the others add zeros: the sum is that row, unrounded
        return self.group.all_reduce_(rows.mul_(mine.unsqueeze(-1).to(rows.dtype)))

    def logits(self, last: torch.Tensor) -> torch.Tensor:
        mine = super().logits(last)
        pad = self.vocab_share - mine.shape[-1]
        # Gathered on every rank: ranks launched from outside each sample, as rank 0 does
        shares = self.group.all_gather(F.pad(mine, (0, pad)) if pad else mine)
        return torch.cat([s[:, :rows] for s, rows in zip(shares, self.vocab_shares, strict=True)], dim=-1)

    def _attention(self, h: torch.Tensor, layer: LayerWeights, cache: LayerKV, *args: object) -> torch.Tensor:
        return self.group.all_reduce_(super()._attention(h, layer, cache, *args))  # type: ignore[arg-type]

    def _mlp(self, h: torch.Tensor, layer: LayerWeights) -> torch.Tensor:
        return self.group.all_reduce_(super()._mlp(h, layer))
