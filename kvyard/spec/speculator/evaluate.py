"""What verification would accept from a drafter, estimated offline on held-out distilled samples.

A drafter that reads only tokens keeps drafting on the true path for as long as its drafts are right,
so its teacher-forced argmax predictions give the accepted run from any position exactly. `replay`
walks an output cycle by cycle as the engine does (k drafts, accept the matching prefix, one target
token), optionally trying prompt lookup first as a speculator with `prompt_lookup` does.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvyard.spec.ngram import lookup
from kvyard.spec.speculator.distill import Sample
from kvyard.spec.speculator.format import LOOKUP_MAX_N, LOOKUP_MIN_N
from kvyard.spec.speculator.model import Drafter


@dataclass
class Replay:
    cycles: int = 0
    proposed: int = 0
    accepted: int = 0

    def add(self, other: "Replay") -> None:
        self.cycles += other.cycles
        self.proposed += other.proposed
        self.accepted += other.accepted

    def summary(self) -> dict[str, float]:
        return {"acceptance_rate": self.accepted / max(1, self.proposed),
                "mean_accepted_length": (self.accepted + self.cycles) / max(1, self.cycles)}


def replay(tokens: Sequence[int], prompt_len: int, pred: Sequence[int], k: int, prompt_lookup: bool) -> Replay:
    """One output's verification cycles; `pred[j]` is the drafter's argmax for output token j given the tokens
    before it. Token 0 comes from the prefill; drafts never run past the output's last token."""
    out = Replay()
    n, i = len(tokens) - prompt_len, 1
    while i < n:
        budget = min(k, n - i - 1)
        draft = lookup(tokens[: prompt_len + i], LOOKUP_MIN_N, LOOKUP_MAX_N, budget) if prompt_lookup else []
        draft = draft or list(pred[i : i + budget])
        if not draft:  # nothing to verify: a plain decode step, as in the engine's counters
            i += 1
            continue
        a = 0
        while a < len(draft) and draft[a] == tokens[prompt_len + i + a]:
            a += 1
        out.add(Replay(1, len(draft), a))
        i += a + 1
    return out


@torch.inference_mode()
def evaluate(drafter: Drafter, samples: list[Sample], ks: tuple[int, ...] = (1, 2, 3, 4)) -> dict:
    """Top-1 agreement with the target's outputs, and per k the acceptance with and without prompt lookup."""
    drafter.eval()
    preds, right, in_vocab, total = [], 0, 0, 0
    for s in samples:
        ids = torch.tensor([s.token_ids[:-1]])
        pred = drafter.token_map[drafter(ids)[0, s.prompt_len - 1 :].argmax(-1)]
        want = torch.tensor(s.token_ids[s.prompt_len :])
        preds.append(pred.tolist())
        right += int((pred == want).sum())
        in_vocab += int(torch.isin(want, drafter.token_map).sum())
        total += len(want)
    out: dict = {"positions": total, "top1_agreement": right / max(1, total),
                 "draft_vocab_coverage": in_vocab / max(1, total)}
    for k in ks:
        for name, with_lookup in (("model", False), ("with_lookup", True)):
            r = Replay()
            for s, pred in zip(samples, preds, strict=True):
                r.add(replay(s.token_ids, s.prompt_len, pred, k, with_lookup))
            out[f"k{k}_{name}"] = r.summary()
    return out
