"""Per-request generation settings, validated when a request arrives."""

from dataclasses import dataclass, field

from kvyard.engine.repetition import RepetitionDetection
from kvyard.errors import InvalidRequestError
from kvyard.structured.spec import StructuredOutput

MAX_LOGPROBS = 20


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
            ("n", isinstance(self.n, int) and 1 <= self.n <= 128, "must be in [1, 128]"),
            ("seed", self.seed is None or isinstance(self.seed, int), "must be an integer"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "must be non-empty strings"),
            ("stop_token_ids", all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "must be token ids"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise InvalidRequestError(f"{name} {why}, got {getattr(self, name)!r}", param=name)
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
