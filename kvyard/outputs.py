"""What the engine hands back: cumulative results plus the increment of the latest step."""

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: dict[int, float]  # the top-n alternatives, token id -> logprob
    rank: int | None = None  # the token's rank in its distribution (1: the likeliest); prompt logprobs only


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "repetition", "abort", "error"
    stop_reason: str | int | None = None  # the stop string or token that ended it
    logprobs: list[TokenLogprob] | None = None
    # The part produced since the previous output of this request (for streaming).
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict[str, float] = field(default_factory=dict)
    # SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (nothing predicts it).
    prompt_logprobs: list[TokenLogprob | None] | None = None
