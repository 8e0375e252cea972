"""A request's state inside the engine: its tokens, how many have KV, and where that KV lives."""

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvyard.outputs import TokenLogprob
from kvyard.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvyard.engine.soft_tokens import SoftTokens
    from kvyard.structured.matcher import GrammarState


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    eos_token_ids: tuple[int, ...] = ()
    # prompt + generated tokens; after a preemption the engine recomputes KV for all of them.
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    lora: str | None = None  # the LoRA adapter this request runs with (kvyard/lora/), None: the base model
    cache_salt: bytes = b""  # isolates this request's prefix-cache entries from requests with another salt
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of its full blocks
    # Prompt positions whose embeddings are given (a grafted image's soft tokens), in prompt order
    soft_tokens: "list[SoftTokens]" = field(default_factory=list)
    num_committed_blocks: int = 0  # leading blocks registered in the prefix cache
    # The same for the sliding-window layers of a model that also has full-attention ones: their own pool,
    # whose blocks behind the window are given back (kvyard/engine/window_blocks.py).
    window_table: list[int] = field(default_factory=list)
    num_window_committed: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None
    # With params.prompt_logprobs: the prompt's tokens covered so far (the first has none), filled as its
    # prefill chunks run (kvyard/engine/prompt_logprobs.py).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    generator: torch.Generator | None = None
    num_preemptions: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    grammar: "GrammarState | None" = None  # set when params.structured_output constrains the output
    # Drafted tokens to verify this step (kvyard/spec/); never part of token_ids until accepted.
    spec_token_ids: list[int] = field(default_factory=list)
    # Prefill/decode disaggregation: a prefill worker's request keeps its full blocks referenced when it
    # finishes (`held_blocks`), until the decode worker has pulled them (kvyard/engine/kv_handoff.py).
    hold_kv: bool = False
    held_blocks: list[int] = field(default_factory=list)
    # params.logit_bias as (token ids, values) tensors, built once rather than at every sampling step.
    logit_bias: tuple[torch.Tensor, torch.Tensor] | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        if self.params.logprobs is not None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]
        if self.params.logit_bias:
            bias = self.params.logit_bias
            self.logit_bias = (torch.tensor(list(bias), dtype=torch.long),
                               torch.tensor(list(bias.values()), dtype=torch.float32))
        if not self.params.greedy:
            self.generator = torch.Generator()
            self.generator.manual_seed(
                self.params.seed if self.params.seed is not None else torch.seed()
            )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked for and not all computed yet: every prompt position needs its logits."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
