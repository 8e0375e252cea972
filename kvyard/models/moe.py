"""Mixture-of-Experts MLPs: a router picks top-k experts per token; experts run as grouped matmuls.

The experts of a layer are stacked ([experts, in, out] per projection). A step sorts its (token, expert) pairs
by expert and runs each projection as one `torch._grouped_mm` over the sorted rows, so neither tokens nor
experts are looped over in Python. The sums follow transformers' order (each token's experts added in
ascending expert order), so fp32 outputs match its reference loop.

Routers as the families define them (Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE): softmax over the router logits
in fp32, top-k, renormalised over the k when `norm_topk_prob`, cast to the model's dtype. Qwen2-MoE adds a
shared expert scaled by sigmoid(shared_expert_gate(x)). DeepSeek's (`DeepSeekRouting`): scores in fp32 (softmax
in v2; sigmoid in v3, which chooses by score + a learned bias), experts only from the best groups, weights
scaled, and shared experts added ungated.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvyard.errors import ConfigError
from kvyard.models.config import MLA_MODEL_TYPES, ModelConfig
from kvyard.models.linear import Weight, linear
from kvyard.quant.qtensor import QuantizedTensor


@dataclass
class SharedExpert:
    gate_up: Weight  # gate|up [2 * intermediate, hidden], packed for kvyard's kernels as a dense MLP's is
    down: Weight  # [hidden, intermediate]
    gate: torch.Tensor | None  # [1, hidden]: sigmoid of it scales the shared expert's output; None: added as is


@dataclass
class DeepSeekRouting:
    sigmoid: bool  # v3: sigmoid scores; v2: softmax
    choice_bias: torch.Tensor | None  # v3's e_score_correction_bias [experts], fp32: added for the choice only
    groups: int  # experts split into this many groups...
    topk_groups: int  # ...and chosen only within the best of them
    scaling: float  # routed_scaling_factor


@dataclass
class LowBitExperts:
    """One projection of every expert in low-bit codes (weight-only `--quantization`): a scale (and zero point)
    per group of `group` input columns. Dequantized for the step's grouped matmul, all experts at once."""

    q: torch.Tensor  # int8 [experts, out, in]
    scale: torch.Tensor  # float32 [experts, out, groups]
    zero_point: torch.Tensor | None  # [experts, out, groups], asymmetric schemes
    group: int
    dtype: torch.dtype

    @classmethod
    def stack(cls, parts: list[QuantizedTensor], dtype: torch.dtype) -> "LowBitExperts":
        if any(p.outliers is not None for p in parts):
            raise ConfigError("experts keep no outlier columns; quantize them without", param="quantization")
        zps = [p.zero_point for p in parts]
        return cls(torch.stack([p.q for p in parts]), torch.stack([p.scale for p in parts]),
                   None if zps[0] is None else torch.stack(zps), parts[0].group_size, dtype)  # type: ignore[misc]

    def dequantize(self) -> torch.Tensor:
        """[experts, in, out] in the model's dtype, as the grouped matmul takes it."""
        k = self.q.shape[-1]
        q = self.q.float()
        if self.zero_point is not None:
            q -= self.zero_point.float().repeat_interleave(self.group, dim=-1)[..., :k]
        w = q.mul_(self.scale.repeat_interleave(self.group, dim=-1)[..., :k])
        return w.to(self.dtype).transpose(1, 2)


Experts = torch.Tensor | LowBitExperts


@dataclass
class MoeWeights:
    router: torch.Tensor  # [experts, hidden]
    gate_up: Experts  # [experts, hidden, 2 * intermediate] (a transposed view of gate|up rows), or low-bit
    down: Experts  # [experts, intermediate, hidden]
    top_k: int
    norm_topk_prob: bool
    shared: SharedExpert | None = None
    deepseek: DeepSeekRouting | None = None
    # Expert parallelism: each expert's row in gate_up and down on this rank, -1 where another rank holds it;
    # None: this rank holds every expert
    local_index: torch.Tensor | None = None
    # Tokens routed to each expert since the model was loaded (kvyard_moe_* metrics).
    tokens_per_expert: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.tokens_per_expert = torch.zeros(self.num_experts, dtype=torch.long)

    @property
    def num_experts(self) -> int:
        return self.router.shape[0]


def expert_tensor_names(cfg: ModelConfig, layer: int) -> tuple[str, list[tuple[str, str, str]], list[str]]:
    """A sparse layer's checkpoint names: its router, each expert's (gate, up, down), and the shared expert's
    (gate, up, down, its gate) where the family has one. Mixtral keeps w1 (gate), w3 (up), w2 (down)."""
    if cfg.model_type == "mixtral":
        b = f"model.layers.{layer}.block_sparse_moe."
        experts = [tuple(f"{b}experts.{j}.{w}.weight" for w in ("w1", "w3", "w2")) for j in range(cfg.num_experts)]
    else:
        b = f"model.layers.{layer}.mlp."
        experts = [tuple(f"{b}experts.{j}.{w}_proj.weight" for w in ("gate", "up", "down"))
                   for j in range(cfg.num_experts)]
    shared = []
    if cfg.shared_expert_intermediate_size and not cfg.shared_expert_gated:  # deepseek
        shared = [f"{b}shared_experts.{w}_proj.weight" for w in ("gate", "up", "down")]
    elif cfg.shared_expert_intermediate_size:
        shared = [f"{b}shared_expert.{w}_proj.weight" for w in ("gate", "up", "down")] + [f"{b}shared_expert_gate.weight"]
    return b + "gate.weight", experts, shared  # type: ignore[return-value]


def load_moe(cfg: ModelConfig, layer: int, take: Callable[[str], torch.Tensor], weight: Callable[..., Weight],
             dtype: torch.dtype) -> MoeWeights:
    """`take(name)` pops a checkpoint tensor; `weight(*names, gate_up=)` makes a packed linear weight of some."""
    router, expert_names, shared_names = expert_tensor_names(cfg, layer)
    local_index = None
    if cfg.held_experts:
        expert_names = [expert_names[e] for e in cfg.held_experts]
        local_index = torch.full((cfg.num_experts,), -1, dtype=torch.long)
        local_index[list(cfg.held_experts)] = torch.arange(len(cfg.held_experts))
    gates, ups, downs = zip(*[[take(n) for n in names] for names in expert_names], strict=True)
    gate_up: Experts
    down: Experts
    if isinstance(gates[0], QuantizedTensor):
        gate_up = LowBitExperts.stack([QuantizedTensor.cat([g, u]) for g, u in zip(gates, ups, strict=True)], dtype)
        down = LowBitExperts.stack(list(downs), dtype)
    else:
        gate_up, down = stack_experts(list(gates), list(ups), list(downs))
    shared = None
    if shared_names:
        g, u, d = shared_names[:3]
        shared = SharedExpert(weight(g, u, gate_up=True), weight(d), take(shared_names[3]) if len(shared_names) > 3 else None)
    deepseek = None
    if cfg.model_type in MLA_MODEL_TYPES:
        sigmoid = cfg.router_scoring == "sigmoid"
        bias = take(router.replace("weight", "e_score_correction_bias")).float() if sigmoid else None
        deepseek = DeepSeekRouting(sigmoid, bias, cfg.router_groups, cfg.router_topk_groups, cfg.routed_scaling_factor)
    return MoeWeights(take(router), gate_up, down, cfg.num_experts_per_tok, cfg.norm_topk_prob, shared, deepseek,
                      local_index)


def stack_experts(gates: list[torch.Tensor], ups: list[torch.Tensor], downs: list[torch.Tensor]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-expert HF weights ([out, in] each) as the grouped matmuls take them: x @ gate_up[e], h @ down[e]."""
    gate_up = torch.stack([torch.cat([g, u]) for g, u in zip(gates, ups, strict=True)])  # [E, 2I, H]
    down = torch.stack(downs)  # [E, H, I]
    return gate_up.transpose(1, 2), down.transpose(1, 2)


def route(x: torch.Tensor, moe: MoeWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's top-k experts and their weights (in x's dtype), as the HF routers compute them."""
    if moe.deepseek is not None:
        return _route_deepseek(x, moe, moe.deepseek)
    probs = torch.softmax(F.linear(x, moe.router), dim=-1, dtype=torch.float)
    weights, experts = probs.topk(moe.top_k, dim=-1)
    if moe.norm_topk_prob:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights.to(x.dtype), experts


def _route_deepseek(x: torch.Tensor, moe: MoeWeights, rule: DeepSeekRouting) -> tuple[torch.Tensor, torch.Tensor]:
    logits = F.linear(x.float(), moe.router.float())
    scores = logits.sigmoid() if rule.sigmoid else logits.softmax(dim=-1)
    choice = scores if rule.choice_bias is None else scores + rule.choice_bias
    if rule.groups > 1:
        grouped = choice.view(-1, rule.groups, moe.num_experts // rule.groups)
        # a group's worth: v3 sums its best two experts' scores, v2 takes its best one
        worth = grouped.topk(2, dim=-1).values.sum(-1) if rule.sigmoid else grouped.amax(dim=-1)
        best = worth.topk(rule.topk_groups, dim=-1).indices
        keep = torch.zeros_like(worth, dtype=torch.bool).scatter_(1, best, True)
        # v3 rules the other groups' experts out of the choice, v2 zeroes their scores (as transformers does)
        choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf") if rule.sigmoid else 0.0).flatten(1)
    experts = choice.topk(moe.top_k, dim=-1).indices
    weights = scores.gather(1, experts) if rule.sigmoid else choice.gather(1, experts)
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return (weights * rule.scaling).to(x.dtype), experts


def moe_mlp(x: torch.Tensor, moe: MoeWeights, act_mul: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The MoE MLP of rows x [tokens, hidden]; `act_mul` is the family's act(gate) * up on [rows, 2 * inter]."""
    weights, experts = route(x, moe)
    flat = experts.flatten()
    counts = torch.bincount(flat, minlength=moe.num_experts)
    moe.tokens_per_expert += counts
    out = torch.zeros_like(x)
    if moe.local_index is None:
        order = flat.argsort(stable=True)  # (token, expert) pairs grouped by expert, ascending; tokens in order
    else:  # only the pairs whose expert this rank holds; the others' ranks add theirs in the all-reduce
        local = moe.local_index[flat]
        mine = (local >= 0).nonzero().squeeze(1)
        order = mine[local[mine].argsort(stable=True)]
        counts = torch.bincount(local[order], minlength=_experts_held(moe))
    if order.numel():
        offsets = counts.cumsum(0).to(torch.int32)
        token = order // moe.top_k
        h = act_mul(torch._grouped_mm(x[token], _dense(moe.gate_up), offs=offsets))
        y = torch._grouped_mm(h, _dense(moe.down), offs=offsets).mul_(weights.flatten()[order].unsqueeze(1))
        # index_add_ walks the rows in order, so each token's experts are added in ascending expert order.
        out.index_add_(0, token, y)
    if moe.shared is not None:
        s = moe.shared
        shared = linear(act_mul(linear(x, s.gate_up)), s.down)
        out += shared if s.gate is None else torch.sigmoid(F.linear(x, s.gate)) * shared
    return out


def _experts_held(moe: MoeWeights) -> int:
    w = moe.down
    return (w.q if isinstance(w, LowBitExperts) else w).shape[0]


def _dense(w: Experts) -> torch.Tensor:
    return w.dequantize() if isinstance(w, LowBitExperts) else w


def routing_stats(moes: list[MoeWeights]) -> tuple[tuple[int, ...], float]:
    """Tokens routed to each expert so far, summed over the layers, and the imbalance: per layer the busiest
    expert's tokens over the mean expert's, averaged over the layers (1.0 is perfectly even)."""
    if not moes:
        return (), 0.0
    stacked = torch.stack([m.tokens_per_expert for m in moes])  # [layers, experts]
    per_layer = stacked.max(dim=1).values / stacked.float().mean(dim=1).clamp(min=1e-9)
    return tuple(stacked.sum(dim=0).tolist()), float(per_layer.mean())
