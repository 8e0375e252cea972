"""Per-request generation settings, validated when a request arrives."""

from dataclasses import dataclass, field

from kvyard.engine.repetition import RepetitionDetection
from kvyard.errors import InvalidRequestError
from kvyard.structured.spec import StructuredOutput

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # OpenAI's range: +-100 bans or forces a token, anything between nudges it


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 means no limit
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # number of top alternatives to return with each sampled token
    # vLLM's prompt_logprobs: each prompt token's logprob (the first has none) and the top-n alternatives.
    prompt_logprobs: int | None = None
    # OpenAI's logit_bias: token id -> value added to its logit before sampling (after penalties, before a
    # grammar's mask, so a grammar still decides what is allowed).
    logit_bias: dict[int, float] | None = None
    n: int = 1
    skip_special_tokens: bool = True
    # Finish with "repetition" when the output loops (kvyard/engine/repetition.py); None: never.
    repetition_detection: RepetitionDetection | None = None
    # Constrain the output to a grammar (JSON schema, regex, choice, EBNF/Lark); see kvyard/structured/.
    structured_output: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.repetition_detection, dict):  # the offline API's shorthand
            self.repetition_detection = RepetitionDetection.from_dict(self.repetition_detection)
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def validate(self) -> None:
        checks = [
            ("max_tokens", isinstance(self.max_tokens, int) and self.max_tokens >= 1, "must be an integer >= 1"),
            ("temperature", 0.0 <= self.temperature <= 100.0, "must be in [0, 100]"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", isinstance(self.top_k, int) and self.top_k >= -1, "must be -1, 0 or a positive integer"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "must be in [0, 1]"),
            ("repetition_penalty", 0.0 < self.repetition_penalty <= 100.0, "must be in (0, 100]"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "must be in [-2, 2]"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "must be in [-2, 2]"),
            ("min_tokens", isinstance(self.min_tokens, int) and 0 <= self.min_tokens, "must be >= 0"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, f"must be in [0, {MAX_LOGPROBS}]"),
            ("prompt_logprobs", self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
             f"must be in [0, {MAX_LOGPROBS}]"),
            ("n", isinstance(self.n, int) and 1 <= self.n <= 128, "must be in [1, 128]"),
            ("seed", self.seed is None or isinstance(self.seed, int), "must be an integer"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "must be non-empty strings"),
            ("stop_token_ids", all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "must be token ids"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise InvalidRequestError(f"{name} {why}, got {getattr(self, name)!r}", param=name)
        self._validate_logit_bias()
        if self.repetition_detection is not None:
            if not isinstance(self.repetition_detection, RepetitionDetection):
                raise InvalidRequestError("repetition_detection must be a RepetitionDetection",
                                          param="repetition_detection")
            self.repetition_detection.validate()
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutput):
            raise InvalidRequestError("structured_output must be a StructuredOutput",
                                      param="structured_output")
        if self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})", param="min_tokens"
            )

    def _validate_logit_bias(self) -> None:
        """Ids must be token ids (the engine checks them against its vocabulary), values within +-100."""
        if self.logit_bias is None:
            return
        if not isinstance(self.logit_bias, dict):
            raise InvalidRequestError("logit_bias must map token ids to numbers", param="logit_bias")
        for token, value in self.logit_bias.items():
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                raise InvalidRequestError(f"logit_bias keys must be token ids, got {token!r}", param="logit_bias")
            if (not isinstance(value, int | float) or isinstance(value, bool)
                    or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS):
                raise InvalidRequestError(
                    f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {value!r} "
                    f"for token {token}", param="logit_bias")
