"""A measured model of one engine step's time, for stall-free batching.

A step costs about `a + b * tokens + c * attended`: a fixed part (Python, sampling, the per-layer kernel
launches), the matmuls, linear in the tokens the step carries, and attention, linear in `attended`, the
query-key pairs of the step (a new token at position p attends to p + 1 keys). The coefficients are fitted
online from the engine's own steps by least squares with forgetting, so the model follows this machine, this
model and this thread count, and adapts when they drift; nothing is calibrated by hand.

The scheduler asks how many prompt tokens fit beside the running decodes so that the step stays within an
inter-token target (Sarathi-Serve's stall-free batching: decodes never wait behind a big prefill chunk).
"""

from dataclasses import dataclass

import numpy as np

ATTENDED_UNIT = 1000.0  # attended pairs are counted in thousands, so the three features are of like size


@dataclass
class StepShape:
    """What a step carries: its tokens and the query-key pairs its attention computes."""

    tokens: int = 0
    attended: int = 0

    def add(self, start: int, n: int) -> None:
        """A request's positions [start, start + n)."""
        self.tokens += n
        self.attended += n * start + n * (n + 1) // 2

    def plus(self, start: int, n: int) -> "StepShape":
        shape = StepShape(self.tokens, self.attended)
        shape.add(start, n)
        return shape


class StepCostModel:
    """Recursive least squares over (1, tokens, attended) with exponential forgetting."""

    def __init__(self, forgetting: float = 0.98, min_samples: int = 5, min_token_spread: float = 16.0):
        self.forgetting = forgetting
        self.min_samples = min_samples
        # A fit is trusted only when steps of clearly different sizes were seen: a run of decode steps alone
        # says nothing about what a prefill token costs.
        self.min_token_spread = min_token_spread
        self._gram = np.zeros((3, 3))
        self._moment = np.zeros(3)
        self.samples = 0
        self._coef: np.ndarray | None = None

    @staticmethod
    def _features(shape: StepShape) -> np.ndarray:
        return np.array([1.0, float(shape.tokens), shape.attended / ATTENDED_UNIT])

    def observe(self, shape: StepShape, seconds: float) -> None:
        x = self._features(shape)
        self._gram = self.forgetting * self._gram + np.outer(x, x)
        self._moment = self.forgetting * self._moment + x * seconds
        self.samples += 1
        self._coef = self._solve()

    def _solve(self) -> np.ndarray | None:
        if self.samples < self.min_samples:
            return None
        weight, mean = self._gram[0, 0], self._gram[0, 1] / self._gram[0, 0]
        if self._gram[1, 1] / weight - mean * mean < self.min_token_spread**2:
            return None
        ridge = 1e-9 * np.trace(self._gram) * np.eye(3)  # attended can be collinear with tokens (no context)
        coef = np.linalg.solve(self._gram + ridge, self._moment)
        # A token or a key never makes a step cheaper. When the steps seen cannot tell the two apart (say, one
        # long prompt and then decodes), or noise made either negative, fit tokens alone.
        if coef[1] <= 0 or coef[2] < 0:
            sub = self._gram[:2, :2] + ridge[:2, :2]
            coef = np.array([*np.linalg.solve(sub, self._moment[:2]), 0.0])
            if coef[1] <= 0:
                return None
        return coef

    @property
    def ready(self) -> bool:
        return self._coef is not None

    @property
    def coefficients(self) -> tuple[float, float, float]:
        """Seconds a step, a token and a thousand query-key pairs; only when `ready`."""
        assert self._coef is not None, "the step cost model has no fit yet"
        return float(self._coef[0]), float(self._coef[1]), float(self._coef[2])

    def predict(self, shape: StepShape) -> float:
        """Seconds for a step of this shape; only when `ready`."""
        assert self._coef is not None, "the step cost model has no fit yet"
        return float(self._features(shape) @ self._coef)

    def fit_tokens(self, shape: StepShape, start: int, most: int, limit_s: float) -> int:
        """The most tokens of a request at position `start` (up to `most`) that `shape` can take on and still
        cost at most `limit_s`; 0 when not even one fits."""
        low, high = 0, most  # the cost grows with n: bisect for the last n within the limit
        while low < high:
            mid = (low + high + 1) // 2
            if self.predict(shape.plus(start, mid)) <= limit_s:
                low = mid
            else:
                high = mid - 1
        return low
