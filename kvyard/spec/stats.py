"""Counters of speculative decoding, as the engine reports them (and Prometheus exports them)."""

from dataclasses import dataclass


@dataclass
class SpecStats:
    proposed_tokens: int = 0  # drafts that were verified
    accepted_tokens: int = 0
    verify_steps: int = 0  # (request, step) pairs that verified at least one draft
    emitted_tokens: int = 0  # tokens those verifications emitted (accepted + replacement or bonus)
    drafter_seconds: float = 0.0
    drafter_steps: int = 0  # engine steps in which the drafter ran

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.proposed_tokens if self.proposed_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification (1 means no draft helped; k + 1 is the most)."""
        return self.emitted_tokens / self.verify_steps if self.verify_steps else 0.0

    @property
    def drafter_seconds_per_step(self) -> float:
        return self.drafter_seconds / self.drafter_steps if self.drafter_steps else 0.0
