"""How many tokens each request drafts: as many as its observed acceptance makes worth verifying.

Each request keeps an EWMA of its per-token acceptance a. Draft j is only useful if drafts 1..j are
all accepted, which happens with probability about a**j; the request drafts the largest k <= k_max
with a**k >= min_gain. A request whose acceptance fell to k = 0 still drafts one token every
`probe_every` steps, so a workload that starts matching later is noticed.
"""

from dataclasses import dataclass, field


@dataclass
class _State:
    acceptance: float
    steps_off: int = 0


@dataclass
class AdaptiveK:
    k_max: int
    adaptive: bool = True
    prior: float = 0.8  # optimistic start: a new request tries (almost) k_max
    smoothing: float = 0.3  # weight of the newest observation
    min_gain: float = 0.15
    probe_every: int = 8
    _states: dict[str, _State] = field(default_factory=dict)

    def k_for(self, request_id: str) -> int:
        if not self.adaptive:
            return self.k_max
        st = self._states.setdefault(request_id, _State(self.prior))
        k = 0
        while k < self.k_max and st.acceptance ** (k + 1) >= self.min_gain:
            k += 1
        if k == 0:
            st.steps_off += 1
            if st.steps_off >= self.probe_every:
                st.steps_off = 0
                return 1
        return k

    def observe(self, request_id: str, proposed: int, accepted: int) -> None:
        """One verification: `accepted` of `proposed` drafts were kept (the first rejection ends it)."""
        if proposed <= 0:
            return
        st = self._states.setdefault(request_id, _State(self.prior))
        # Tokens actually tested: every accepted one, plus the rejected one if the run stopped early.
        tested = accepted + (1 if accepted < proposed else 0)
        st.acceptance += self.smoothing * (accepted / tested - st.acceptance)

    def forget(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def acceptance(self, request_id: str) -> float:
        st = self._states.get(request_id)
        return self.prior if st is None else st.acceptance

    def retain(self, request_ids: set[str]) -> None:
        """Forget the requests that are no longer running (finished, aborted or preempted)."""
        for rid in [r for r in self._states if r not in request_ids]:
            del self._states[rid]
