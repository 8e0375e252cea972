"""How far a quantized model's next-token distribution moves from the full-precision one.

All figures come from teacher-forced passes over calibration sequences: the same tokens go through both
models, and each position's distributions are compared. KL(p_full || p_quant) per token is the main
figure; top-1 agreement and perplexity on the sequences themselves come with it.
"""

from dataclasses import asdict, dataclass

import torch

from kvyard.models.attention import AttentionMetadata, PrefillSpan, causal_context_mask
from kvyard.models.decoder import DecoderModel
from kvyard.models.kv_layer import LayerKV


@dataclass
class Fidelity:
    kl_mean: float
    kl_p99: float
    kl_max: float
    top1_agreement: float  # share of positions where both models' argmax agree
    ppl_full: float
    ppl_quant: float
    tokens: int

    @property
    def ppl_change(self) -> float:
        return self.ppl_quant / self.ppl_full - 1.0

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "ppl_change": self.ppl_change}


def sequence_logits(model: DecoderModel, ids: list[int]) -> torch.Tensor:
    """fp32 logits [len(ids), vocab] for every position of one sequence."""
    return batch_logits(model, [ids])[0]


def batch_logits(model: DecoderModel, seqs: list[list[int]], kv_int8: bool = False) -> list[torch.Tensor]:
    """Every position's logits for several sequences, in one forward pass (one causal span each).

    One pass with large matmuls is much faster on CPU than a pass per sequence; a scratch KV cache
    holds just these tokens. With `kv_int8` the cache is int8 and attention reads every key back from
    it, as decode steps do, so the figures include the KV cache's own rounding.
    """
    p = PrefillBatch.build(model, seqs, kv_int8)
    logits = model.forward(p.ids, p.positions, p.meta, p.caches, p.meta.slot_mapping)
    return list(logits.split([len(s) for s in seqs]))


@dataclass
class PrefillBatch:
    """Several sequences as one flat prefill: token ids, positions, spans and a scratch KV cache per layer."""

    ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    caches: list[LayerKV]

    @classmethod
    def build(cls, model: DecoderModel, seqs: list[list[int]], kv_int8: bool = False,
              layers: int | None = None) -> "PrefillBatch":
        """`layers` caches (default: one per model layer; one suffices to run the layers one at a time)."""
        n, cfg, dev = sum(map(len, seqs)), model.cfg, model.device
        caches = [LayerKV.allocate(n, cfg.num_kv_heads, cfg.head_dim, model.dtype, dev, kv_int8)
                  for _ in range(cfg.num_layers if layers is None else layers)]
        rows = torch.arange(n, device=dev)
        starts = [0]
        for s in seqs:
            starts.append(starts[-1] + len(s))
        spans = [
            PrefillSpan(a, b, rows[a:b], causal_context_mask(b - a, b - a, dev)) if kv_int8
            else PrefillSpan(a, b, None, None)
            for a, b in zip(starts, starts[1:], strict=False)
        ]
        positions = torch.cat([torch.arange(len(s), device=dev) for s in seqs])
        meta = AttentionMetadata(slot_mapping=rows, block_size=1, prefills=spans)
        ids = torch.tensor([t for s in seqs for t in s], device=dev)
        return cls(ids, positions, meta, caches)


def kl_per_token(ref_logprobs: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per row, with p given as log-probabilities and q as logits."""
    q_logprobs = logits.float().log_softmax(-1)
    return (ref_logprobs.exp() * (ref_logprobs - q_logprobs)).sum(-1).clamp(min=0.0)


def _nll(logprobs: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """Negative log-likelihood of each next token (positions 0..n-2 predict ids 1..n-1)."""
    target = torch.tensor(ids[1:], device=logprobs.device)
    return -logprobs[:-1].gather(1, target.unsqueeze(1)).squeeze(1)


class FidelityMeter:
    """Holds the full-precision distributions of the calibration set; measures any model against them."""

    def __init__(self, reference: DecoderModel, sequences: list[list[int]]):
        self.sequences = [s for s in sequences if len(s) >= 2]
        self.ref_logprobs = [lg.log_softmax(-1) for lg in batch_logits(reference, self.sequences)]
        self.ref_nll = torch.cat([_nll(lp, s) for lp, s in zip(self.ref_logprobs, self.sequences, strict=True)])

    def measure(self, model: DecoderModel, kv_int8: bool = False) -> Fidelity:
        return self.measure_logits(batch_logits(model, self.sequences, kv_int8))

    def measure_logits(self, logits_all: list[torch.Tensor]) -> Fidelity:
        """Against logits computed elsewhere (another engine's), one [len, vocab] tensor per sequence."""
        kls, agree, nlls = [], [], []
        for ids, ref, logits in zip(self.sequences, self.ref_logprobs, logits_all, strict=True):
            kls.append(kl_per_token(ref, logits))
            agree.append(ref.argmax(-1) == logits.argmax(-1))
            nlls.append(_nll(logits.log_softmax(-1), ids))
        kl = torch.cat(kls)
        return Fidelity(
            kl_mean=float(kl.mean()),
            kl_p99=float(torch.quantile(kl.double(), 0.99)),
            kl_max=float(kl.max()),
            top1_agreement=float(torch.cat(agree).float().mean()),
            ppl_full=float(self.ref_nll.mean().exp()),
            ppl_quant=float(torch.cat(nlls).mean().exp()),
            tokens=int(kl.numel()),
        )
