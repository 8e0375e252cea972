"""Tensor parallelism (Megatron-LM's layout): each rank of a group holds a slice of every layer's weights.

- q, k, v: column-parallel, sharded by heads. With fewer KV heads than ranks, each KV head is replicated on
  the ranks whose query heads use it (rank r holds KV head r * kv_heads // ranks).
- o_proj and down_proj: row-parallel; each rank's product is a partial sum, all-reduced before the residual add.
- gate|up: column-parallel, by the intermediate dimension. In a Mixture-of-Experts layer each expert's gate|up
  and down are sliced the same way (the router is whole on every rank), and so is a shared expert's; with
  expert parallelism (kvyard/parallel/expert.py) the experts are instead held whole, a share of them a rank.
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
from kvyard.parallel.expert import expert_placement as place_experts
from kvyard.parallel.shares import contiguous_share
from kvyard.quant.qtensor import QuantizedTensor

# Families whose attention is the plain decoder's, with dense or MoE MLPs (OLMoE's norm over all heads at
# once, latent attention and Gemma's sandwich norms come later)
TP_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe")

_LAYER = r"model\.layers\.\d+\."
_COLUMN_HEADS = re.compile(_LAYER + r"self_attn\.q_proj\.(weight|bias)$")
_COLUMN_KV_HEADS = re.compile(_LAYER + r"self_attn\.[kv]_proj\.(weight|bias)$")
_ROW_HEADS = re.compile(_LAYER + r"self_attn\.o_proj\.weight$")
# dense and shared-expert MLPs (qwen2_moe's shared_expert, DeepSeek's shared_experts)
_COLUMN_FFN = re.compile(_LAYER + r"mlp\.(shared_experts?\.)?(gate|up)_proj\.weight$")
_ROW_FFN = re.compile(_LAYER + r"mlp\.(shared_experts?\.)?down_proj\.weight$")
# routed experts: qwen's mlp.experts.N.{gate,up,down}_proj, Mixtral's block_sparse_moe.experts.N.{w1,w3,w2}
_EXPERT = re.compile(_LAYER + r"(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|w1|w3|down_proj|w2)\.weight$")
_EXPERT_ROW = ("down_proj", "w2")
_VOCAB = re.compile(r"(model\.embed_tokens|lm_head)\.weight$")


class Collective(Protocol):
    """The group's communication: rank, size, and an in-place sum across ranks."""

    rank: int
    size: int

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor: ...

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `t` (the same shape on each), in rank order, on every rank."""
        ...

    def all_gather_columns(self, t: torch.Tensor, widths: list[int]) -> torch.Tensor:
        """Every rank's [rows, widths[rank]] tensor side by side, in rank order, on every rank."""
        ...


def valid_tensor_parallel_sizes(cfg: ModelConfig, experts: bool = False, most: int = 64) -> list[int]:
    return [n for n in range(1, most + 1) if _divides(cfg, n, experts)]


def _has_dense_mlp(cfg: ModelConfig) -> bool:
    return not (cfg.sparse_layers and all(cfg.sparse_layers))


def _divides(cfg: ModelConfig, ranks: int, experts: bool) -> bool:
    """Whether `ranks` split the heads, the dense and shared MLPs, and (unless `experts`: whole experts a rank)
    each expert's intermediate size."""
    kv = cfg.num_kv_heads
    kv_ok = kv % ranks == 0 or (ranks % kv == 0 and cfg.num_heads // ranks * ranks == cfg.num_heads)
    sliced = [cfg.shared_expert_intermediate_size]
    if _has_dense_mlp(cfg):
        sliced.append(cfg.intermediate_size)
    if cfg.num_experts and not experts:
        sliced.append(cfg.moe_intermediate_size)
    enough_experts = not experts or cfg.num_experts >= ranks
    return cfg.num_heads % ranks == 0 and kv_ok and all(n % ranks == 0 for n in sliced) and enough_experts


def check_tensor_parallel(cfg: ModelConfig, ranks: int, experts: bool = False) -> None:
    """A clear error for a model this many ranks cannot split, naming the sizes that would work. `experts`:
    with expert parallelism, which needs a Mixture-of-Experts model."""
    if cfg.model_type not in TP_MODEL_TYPES:
        raise ConfigError(f"tensor parallelism supports {', '.join(TP_MODEL_TYPES)} for now, not {cfg.model_type}",
                          param="tensor_parallel_size")
    if experts and not cfg.num_experts:
        raise ConfigError(f"expert parallelism needs a Mixture-of-Experts model; {cfg.model_type} has no experts",
                          param="enable_expert_parallel")
    if ranks < 1 or not _divides(cfg, ranks, experts):
        sizes = [f"{cfg.num_heads} attention heads", f"{cfg.num_kv_heads} KV heads"]
        if _has_dense_mlp(cfg):
            sizes.append(f"intermediate size {cfg.intermediate_size}")
        if cfg.num_experts:
            sizes.append(f"{cfg.num_experts} experts" if experts else
                         f"expert intermediate size {cfg.moe_intermediate_size}")
        if cfg.shared_expert_intermediate_size:
            sizes.append(f"shared expert intermediate size {cfg.shared_expert_intermediate_size}")
        raise ConfigError(
            f"tensor_parallel_size {ranks} does not divide this model ({', '.join(sizes)}); sizes that do: "
            f"{', '.join(map(str, valid_tensor_parallel_sizes(cfg, experts)))}", param="tensor_parallel_size")


def local_config(cfg: ModelConfig, ranks: int, experts: bool = False) -> ModelConfig:
    """The model as one rank of `ranks` sees it: its share of the heads, KV heads and intermediate sizes (whole
    experts with expert parallelism: which ones, the rank's model says)."""
    check_tensor_parallel(cfg, ranks, experts)
    return replace(cfg, num_heads=cfg.num_heads // ranks, num_kv_heads=max(1, cfg.num_kv_heads // ranks),
                   intermediate_size=cfg.intermediate_size // ranks if _has_dense_mlp(cfg) else cfg.intermediate_size,
                   moe_intermediate_size=cfg.moe_intermediate_size // (1 if experts else ranks),
                   shared_expert_intermediate_size=cfg.shared_expert_intermediate_size // ranks)


def vocab_range(vocab_size: int, rank: int, ranks: int) -> tuple[int, int]:
    """The rows [start, stop) of the embedding and LM head that rank `rank` holds: near-equal shares, the
    first `vocab_size % ranks` ranks one row more (a vocabulary need not divide by the ranks)."""
    rows = contiguous_share(vocab_size, ranks, rank)
    return rows.start, rows.stop


def kv_head_of(cfg: ModelConfig, rank: int, ranks: int) -> int:
    """With fewer KV heads than ranks: the one KV head rank `rank` holds (its query heads' group)."""
    return rank * cfg.num_kv_heads // ranks


Tensor = torch.Tensor | QuantizedTensor


def shard_tensor(name: str, t: Tensor, cfg: ModelConfig, rank: int, ranks: int, experts: bool = False) -> Tensor:
    """Rank `rank`'s slice of the checkpoint tensor `name` (global HF names; whole where it is replicated, and
    a routed expert's whole with expert parallelism, `experts`)."""
    if ranks == 1:
        return t
    expert = _EXPERT.match(name)
    if expert:
        return t if experts else _chunk(t, 1 if expert.group(2) in _EXPERT_ROW else 0, rank, ranks)
    d = cfg.head_dim
    if _COLUMN_HEADS.match(name):
        return _chunk(t, 0, rank, ranks)
    if _COLUMN_KV_HEADS.match(name):
        if cfg.num_kv_heads >= ranks:
            return _chunk(t, 0, rank, ranks)
        head = kv_head_of(cfg, rank, ranks)
        return _part(t, 0, head * d, (head + 1) * d)
    if _ROW_HEADS.match(name) or _ROW_FFN.match(name):
        return _chunk(t, 1, rank, ranks)
    if _COLUMN_FFN.match(name):
        return _chunk(t, 0, rank, ranks)
    if _VOCAB.match(name):
        return _part(t, 0, *vocab_range(cfg.vocab_size, rank, ranks))
    return t


def _chunk(t: Tensor, dim: int, rank: int, ranks: int) -> Tensor:
    share = t.shape[dim] // ranks
    return _part(t, dim, rank * share, (rank + 1) * share)


def _part(t: Tensor, dim: int, start: int, stop: int) -> Tensor:
    """Rows (dim 0) or input columns (dim 1) start..stop-1, of a dense or a low-bit weight (the same codes)."""
    if isinstance(t, QuantizedTensor):
        return t.rows(start, stop) if dim == 0 else t.cols(start, stop)
    return t.narrow(dim, start, stop - start).contiguous()


def shard_stream(tensors: Iterable[tuple[str, Tensor]], cfg: ModelConfig, rank: int, ranks: int,
                 held_experts: tuple[int, ...] = ()) -> Iterator[tuple[str, Tensor]]:
    """Each tensor's slice for this rank; with expert parallelism (`held_experts`) the other ranks' experts are
    dropped unread into memory."""
    held = set(held_experts)
    for name, t in tensors:
        expert = _EXPERT.match(name) if held else None
        if expert and int(expert.group(1)) not in held:
            continue
        try:
            share = shard_tensor(name, t, cfg, rank, ranks, experts=bool(held))
        except ValueError as e:  # a low-bit weight that cannot be cut where this rank's share starts
            raise ConfigError(f"{name}: {e}; tensor_parallel_size {ranks} cannot split this low-bit checkpoint",
                              param="tensor_parallel_size") from e
        yield name, share


class TensorParallelDecoder(DecoderModel):
    """One rank's share of a plain decoder: its attention and MLP outputs are partial sums, all-reduced.
    `expert_placement` (contiguous or round_robin): expert parallelism, whole experts placed by that map."""

    def __init__(self, cfg: ModelConfig, group: Collective, dtype: torch.dtype, device: torch.device,
                 max_positions: int, max_rows: int | None = None, expert_placement: str | None = None):
        self.full_config = cfg
        self.group = group
        self.vocab_range = vocab_range(cfg.vocab_size, group.rank, group.size)
        self.vocab_shares = [stop - start for start, stop in
                             (vocab_range(cfg.vocab_size, r, group.size) for r in range(group.size))]
        start, stop = self.vocab_range
        experts = expert_placement is not None
        share = replace(local_config(cfg, group.size, experts), vocab_size=stop - start)
        # The experts each rank holds, by rank (rank 0 reports every rank's load from it); None: all, sliced
        self.expert_placement = None
        if expert_placement is not None:
            self.expert_placement = place_experts(cfg.num_experts, group.size, expert_placement)
            share = replace(share, held_experts=self.expert_placement[group.rank])
        super().__init__(share, dtype, device, max_positions, max_rows)

    def load(self, tensors: Iterable[tuple[str, torch.Tensor | QuantizedTensor]], source: str) -> None:
        full = self.full_config
        super().load(shard_stream(tensors, full, self.group.rank, self.group.size, self.cfg.held_experts), source)

    def _decode_stack(self) -> torch.ScriptObject | None:
        return None  # the C++ stack runs every layer at once, with no all-reduce between them

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        start, stop = self.vocab_range
        mine = (input_ids >= start) & (input_ids < stop)
        rows = F.embedding((input_ids - start).clamp_(0, stop - start - 1), self.embed)
        # Exactly one rank holds each token's row and the others add zeros: the sum is that row, unrounded
        return self.group.all_reduce_(rows.mul_(mine.unsqueeze(-1).to(rows.dtype)))

    def logits(self, last: torch.Tensor) -> torch.Tensor:
        # Gathered on every rank: ranks launched from outside each sample, as rank 0 does
        return self.group.all_gather_columns(super().logits(last), self.vocab_shares)

    def _attention(self, h: torch.Tensor, layer: LayerWeights, cache: LayerKV, *args: object) -> torch.Tensor:
        return self.group.all_reduce_(super()._attention(h, layer, cache, *args))  # type: ignore[arg-type]

    def _mlp(self, h: torch.Tensor, layer: LayerWeights) -> torch.Tensor:
        return self.group.all_reduce_(super()._mlp(h, layer))
