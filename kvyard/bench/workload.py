"""Synthetic workloads shared by all benchmark peers: random in-vocabulary tokens, given lengths."""

import random
from dataclasses import dataclass


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def input_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def random_workload(tokenizer, num: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                    seed: int = 0) -> Workload:
    """Lengths drawn uniformly from [len * (1 - r), len * (1 + r)], as vLLM's random dataset does."""
    rng = random.Random(seed)
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(len(tokenizer)) if i not in special]

    def length(n: int) -> int:
        return max(1, rng.randint(int(n * (1 - range_ratio)), int(n * (1 + range_ratio))))

    prompts = [[rng.choice(vocab) for _ in range(length(input_len))] for _ in range(num)]
    return Workload(prompts, [length(output_len) for _ in range(num)])
