"""Expert parallelism (`--enable-expert-parallel`): a tensor-parallel group whose ranks hold whole experts.

Without it, a Mixture-of-Experts layer under tensor parallelism slices every expert (gate|up by its
intermediate rows, down by its columns), as a dense MLP is sliced: each rank runs every expert a token chose,
on its slice. With it, each rank holds a share of the experts whole, placed by a map:
- contiguous: rank r holds a run of consecutive experts (0-3, 4-7 for 8 experts on 2 ranks);
- round_robin: expert e lives on rank e % ranks (0, 2, 4, 6 and 1, 3, 5, 7), which spreads neighbouring
  experts (often popular together) over the ranks.
Experts need not divide by the ranks: the first ones hold one more.

Attention stays tensor-parallel, so after its all-reduce every rank has every token's hidden state. Routing is
replicated (the router is whole on each rank, and gives each the same choice), so dispatch is local: a rank
runs only the (token, expert) pairs whose expert it holds. Combining is the all-reduce the layer ends with
anyway: each rank's rows are partial sums (zero for tokens none of its experts took). On CPU this is the
all-gather/reduce-scatter form (here fused into one all-reduce of the replicated tokens); an all-to-all, which
sends each token only to its experts' ranks, pays off where a backend has one (NCCL).

A shared expert (qwen2_moe, DeepSeek) is sliced like a dense MLP, and its partial sums join the same all-reduce.
"""

from kvyard.errors import ConfigError
from kvyard.parallel.shares import contiguous_share

PLACEMENTS = ("contiguous", "round_robin")


def expert_placement(num_experts: int, ranks: int, how: str = "contiguous") -> list[tuple[int, ...]]:
    """The experts each rank holds, ascending, by rank."""
    if how not in PLACEMENTS:
        raise ConfigError(f"expert_placement must be one of {', '.join(PLACEMENTS)}, not {how!r}",
                          param="expert_placement")
    if num_experts < ranks:
        raise ConfigError(f"expert parallelism over {ranks} ranks needs at least as many experts per layer; this "
                          f"model has {num_experts}", param="tensor_parallel_size")
    if how == "round_robin":
        return [tuple(range(r, num_experts, ranks)) for r in range(ranks)]
    return [tuple(contiguous_share(num_experts, ranks, r)) for r in range(ranks)]


def rank_loads(tokens_per_expert: tuple[int, ...], placement: list[tuple[int, ...]]) -> tuple[int, ...]:
    """Tokens routed to the experts each rank holds (every rank routes alike, so rank 0's counts are all)."""
    return tuple(sum(tokens_per_expert[e] for e in held) for held in placement)
