"""Key smoothing for the int8 KV cache: large key channels no longer take the int8 range from the others.

The int8 cache scales each token/head row of K by its own absolute maximum. Some models have key channels
that are large at every token (Qwen2.5's reach 13x the mean channel's peak), so the rest of the row keeps a
few levels: on Qwen2.5-Coder-0.5B the int8 cache alone cost a mean KL of 5.3e-2. Dividing a key channel by a
factor and multiplying the matching query channel by it leaves every q . k as it was, and where the factor is
the same for the two channels RoPE rotates together it commutes with RoPE, so both are applied to the
projections' outputs before RoPE (`LayerWeights.qk_scale`). The factors are powers of two, so the scaling is
exact in every float format: with a dense cache the model computes bit for bit what it did before.

Each pair's factor is its peak norm on a short built-in text (RoPE leaves a pair's norm unchanged) over the
mean of its head's pair peaks, rounded to a power of two; computed once when an engine with an int8 KV cache
loads its model (one prefill of ~600 tokens). `python tools/kv_smoothing_probe.py` measures the effect.
"""

import logging

import torch

from kvyard.models.decoder import DecoderModel
from kvyard.quant.fidelity import PrefillBatch

log = logging.getLogger(__name__)

# Fitting text, kept apart from the quantization calibration set, on which the cache's fidelity is measured.
FIT_TEXT = [
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, trimmed the wick, wound the "
    "clockwork that turned the lens, and wrote the weather in a leather logbook before the long night began.",
    "def merge_sorted(a: list[int], b: list[int]) -> list[int]:\n    out, i, j = [], 0, 0\n"
    "    while i < len(a) and j < len(b):\n        if a[i] <= b[j]:\n            out.append(a[i]); i += 1\n"
    "        else:\n            out.append(b[j]); j += 1\n    return out + a[i:] + b[j:]",
    '{"name": "book_table", "arguments": {"restaurant": "Luna", "time": "19:30", "guests": 4, '
    '"notes": ["window seat", "one vegetarian"]}}',
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen. The light reactions happen "
    "in the thylakoid membranes; the Calvin cycle, which fixes carbon, runs in the stroma of the chloroplast.",
    "User: Can you summarise the meeting notes?\nAssistant: Sure. The team agreed to ship the beta on Friday, "
    "move the billing migration to next sprint, and review the on-call rota at the next retrospective.",
    "| city | population | country |\n|---|---|---|\n| Lagos | 15,400,000 | Nigeria |\n| Osaka | 19,000,000 "
    "| Japan |\n| Lima | 10,700,000 | Peru |\nSorted by population, Osaka comes first and Lima last.",
]


def key_pair_peaks(model: DecoderModel, seqs: list[list[int]]) -> list[torch.Tensor]:
    """Per layer, [kv_heads, head_dim / 2]: the largest norm each rotary pair of K reaches over `seqs`."""
    p = PrefillBatch.build(model, seqs)
    with torch.inference_mode():
        model.forward(p.ids, p.positions, p.meta, p.caches, p.meta.slot_mapping[-1:])
    d = model.cfg.head_dim
    return [c.k.float().view(c.k.shape[0], c.k.shape[1], 2, d // 2).norm(dim=2).amax(0) for c in p.caches]


def qk_scales(peaks: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[heads + kv_heads, head_dim] factors for one layer from its pair peaks [kv_heads, head_dim / 2]: each
    query head's rows multiplied by its KV head's factors, each key row divided by them."""
    ratio = peaks.clamp_min(1e-12) / peaks.mean(-1, keepdim=True).clamp_min(1e-12)
    s = torch.exp2(torch.log2(ratio).round())
    s = torch.cat([s, s], dim=-1)  # both channels of a rotary pair (i, i + head_dim / 2)
    return torch.cat([s.repeat_interleave(num_heads // s.shape[0], dim=0), 1.0 / s])


def smooth_keys(model: DecoderModel, tokenizer, max_len: int = 256) -> None:
    """Fit and set every layer's qk_scale on FIT_TEXT (a prefill through `model`, with its scales off)."""
    for layer in model.layers:
        layer.qk_scale = None
    seqs = [tokenizer(t, add_special_tokens=True).input_ids[:max_len] for t in FIT_TEXT]
    peaks = key_pair_peaks(model, seqs)
    spread = max((p.amax(-1) / p.mean(-1)).max().item() for p in peaks)
    for layer, peak in zip(model.layers, peaks, strict=True):
        layer.qk_scale = qk_scales(peak, model.cfg.num_heads).to(device=model.device, dtype=model.dtype)
    log.info("int8 KV cache: key smoothing fitted on %d tokens (largest key pair peak %.1fx its head's mean)",
             sum(map(len, seqs)), spread)
