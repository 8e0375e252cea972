"""The repetition guard: what the server does when a generation loops, per deployment and per request.

The engine detects loops (`kvyard/engine/repetition.py`) and finishes such a request with
`finish_reason: "repetition"`. The guard decides what the client gets:

* `off`: no detection.
* `stop`: the choice ends there, with `finish_reason: "repetition"` (vLLM's behaviour).
* `retry`: the choice is generated again with a new seed and a stronger repetition penalty, up to
  `max_retries` times; the last attempt's result is what the client gets (still "repetition" if it
  loops every time). A stream retries only while nothing of that choice has been sent, then stops.

Deployments set it in `server: repetition_guard: {action: retry, min_count: 4, ...}`; a request may
override any field with its own `repetition_guard` object (which turns a guard that is off to
`stop` unless it names the action), or send vLLM's `repetition_detection`
object (`max_pattern_size`, `min_pattern_size`, `min_count`), which means vLLM's exact token rule and
the `stop` action unless its `repetition_guard` says otherwise.
"""

from dataclasses import dataclass, field, fields, replace
from typing import Any

from kvyard.engine.repetition import RepetitionDetection
from kvyard.errors import InvalidRequestError
from kvyard.sampling_params import SamplingParams

ACTIONS = ("off", "stop", "retry")
MAX_RETRIES = 5  # each retry is a whole generation again: the most one request may cost
_DETECTION_FIELDS = tuple(f.name for f in fields(RepetitionDetection))


@dataclass(frozen=True)
class RepetitionGuard:
    action: str = "off"
    max_retries: int = 2
    # The repetition penalty of the first retry; each later one multiplies it again (1.2, 1.44, ...).
    retry_repetition_penalty: float = 1.2
    detection: RepetitionDetection = field(default_factory=RepetitionDetection)

    @property
    def enabled(self) -> bool:
        return self.action != "off"

    def validate(self, where: str) -> None:
        checks = [
            ("action", self.action in ACTIONS, f"must be one of {', '.join(ACTIONS)}"),
            ("max_retries", isinstance(self.max_retries, int) and not isinstance(self.max_retries, bool)
             and 0 <= self.max_retries <= MAX_RETRIES, f"must be an integer in [0, {MAX_RETRIES}]"),
            ("retry_repetition_penalty", isinstance(self.retry_repetition_penalty, int | float)
             and not isinstance(self.retry_repetition_penalty, bool) and 1.0 <= self.retry_repetition_penalty <= 10.0,
             "must be a number in [1, 10]"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise InvalidRequestError(f"{where}.{name} {why}, got {getattr(self, name)!r}", param=f"{where}.{name}")
        self.detection.validate(where)

    def updated(self, values: dict[str, Any], where: str) -> "RepetitionGuard":
        """This guard with `values` (a flat mapping: guard and detection fields together) laid over it."""
        own = {f.name for f in fields(self)} - {"detection"}
        unknown = sorted(set(values) - own - set(_DETECTION_FIELDS))
        if unknown:
            known = ", ".join(sorted(own | set(_DETECTION_FIELDS)))
            raise InvalidRequestError(f"{where}: unknown field {unknown[0]!r}; known: {known}",
                                      param=f"{where}.{unknown[0]}")
        detection = replace(self.detection, **{k: v for k, v in values.items() if k in _DETECTION_FIELDS})
        guard = replace(self, detection=detection, **{k: v for k, v in values.items() if k in own})
        guard.validate(where)
        return guard

    def retry_params(self, params: SamplingParams, attempt: int) -> SamplingParams:
        """Attempt `attempt` (1, 2, ...): a new seed and a stronger repetition penalty."""
        penalty = min(100.0, max(params.repetition_penalty, 1.0) * self.retry_repetition_penalty**attempt)
        # A seeded request stays reproducible: its retries get seeds derived from its own.
        seed = None if params.seed is None else (params.seed + attempt * 1_000_003) % 2**63
        return replace(params, seed=seed, repetition_penalty=penalty)


def request_guard(deployment: RepetitionGuard, guard: dict[str, Any] | None,
                  vllm: dict[str, Any] | None) -> RepetitionGuard:
    """The guard of one request: the deployment's, then vLLM's object, then the request's own fields."""
    result = deployment
    if vllm is not None:
        detection = RepetitionDetection.from_vllm(**vllm)
        if detection is None:  # vLLM: max_pattern_size 0 turns detection off
            result = replace(result, action="off")
        else:
            detection.validate("repetition_detection")
            result = replace(result, action="stop", detection=detection)
    if guard:
        if "action" not in guard and not result.enabled:
            guard = {**guard, "action": "stop"}  # asking for detection settings asks for detection
        result = result.updated(guard, "repetition_guard")
    return result


def guard_setting(value: Any) -> RepetitionGuard:
    """`repetition_guard` of a deployment file: a mapping of guard and detection fields, or nothing."""
    if isinstance(value, RepetitionGuard):
        value.validate("repetition_guard")
        return value
    if value is None:
        return RepetitionGuard()
    if not isinstance(value, dict):
        raise InvalidRequestError(f"repetition_guard must be a mapping, got {value!r}", param="repetition_guard")
    if value.get("action") is False:
        value = {**value, "action": "off"}  # YAML 1.1 reads an unquoted `off` as false
    return RepetitionGuard().updated(value, "repetition_guard")
