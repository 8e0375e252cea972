"""Synthetic prompts shared by all benchmark peers: random in-vocabulary tokens of a given length."""

import random


def random_prompts(tokenizer, num: int, input_len: int, seed: int = 0) -> list[list[int]]:
    """Token-id prompts drawn from ordinary (non-special) vocabulary, the same for every peer."""
    rng = random.Random(seed)
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(len(tokenizer)) if i not in special]
    return [[rng.choice(vocab) for _ in range(input_len)] for _ in range(num)]
