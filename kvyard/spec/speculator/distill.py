"""Training data for a speculator: the target's own outputs on the workload's prompts (distillation).

The kvyard engine generates them, batched, greedily by default (what greedy verification accepts is
exactly the target's argmax), and returns the target's top-20 logprobs at every output position: the
soft targets the drafter is fitted to, at no extra forward pass.
"""

from collections import Counter
from dataclasses import dataclass

import numpy as np

from kvyard.llm import LLM
from kvyard.sampling_params import MAX_LOGPROBS, SamplingParams


@dataclass
class Sample:
    token_ids: list[int]  # prompt + output
    prompt_len: int
    top_ids: np.ndarray  # [num_output, K] int64: the target's top-K tokens before each output token
    top_logprobs: np.ndarray  # [num_output, K] float32

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len


def distill(llm: LLM, prompts: list[list[int]], max_tokens: int, temperature: float = 0.0,
            seed: int = 0, use_tqdm: bool = True) -> list[Sample]:
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, logprobs=MAX_LOGPROBS)
    samples = []
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=use_tqdm), strict=True):
        done = out.outputs[0]
        if not done.token_ids:
            continue
        ids = np.array([list(lp.top) for lp in done.logprobs], dtype=np.int64)
        lps = np.array([list(lp.top.values()) for lp in done.logprobs], dtype=np.float32)
        samples.append(Sample(list(prompt) + list(done.token_ids), len(prompt), ids, lps))
    return samples


def output_token_counts(samples: list[Sample]) -> Counter:
    counts: Counter = Counter()
    for s in samples:
        counts.update(s.token_ids[s.prompt_len :])
    return counts
