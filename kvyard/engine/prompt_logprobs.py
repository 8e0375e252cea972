"""Prompt logprobs (vLLM's `prompt_logprobs`, and `echo` with `logprobs`): how likely each prompt token was.

The model runner adds a logits row for every prompt position of a request that asks for them, after the
rows that are sampled (`StepInput.prompt_rows`); here they become `TokenLogprob`s, chunk by chunk as the
prefill runs, so chunked prefill gives the same numbers as one pass. The row of position p scores prompt
token p + 1; nothing scores token 0, whose entry stays None.

A cached prefix has KV but no logits, so a request that needs prompt logprobs does not read the prefix
cache until they are complete (`BlockManager.match_prefix`): it recomputes its prompt, exactly as a cold
request would, and still commits its blocks for others. Recomputing only the cached part would cost the
same forward pass over those tokens, in a second code path.
"""

import torch

from kvyard.engine.request import Request
from kvyard.outputs import TokenLogprob


@torch.inference_mode()
def record_prompt_logprobs(logits: torch.Tensor, rows: list[tuple[Request, int, int]]) -> None:
    """Append to each request's `prompt_logprobs` from its rows of `logits` (in the order of `rows`)."""
    offset = 0
    for req, first, count in rows:
        scored = req.prompt_logprobs
        assert scored is not None and len(scored) == first + 1, "prompt positions must be scored in order"
        logprobs = logits[offset : offset + count].float().log_softmax(-1)
        offset += count
        targets = req.prompt_token_ids[first + 1 : first + 1 + count]
        chosen = logprobs.gather(1, torch.tensor(targets, device=logprobs.device).unsqueeze(1))
        ranks = ((logprobs > chosen).sum(-1) + 1).tolist()
        n = req.params.prompt_logprobs or 0
        top_vals, top_ids = logprobs.topk(n) if n else (logprobs[:, :0], logprobs[:, :0].long())
        for token, value, rank, ids, vals in zip(targets, chosen.squeeze(1).tolist(), ranks, top_ids.tolist(),
                                                  top_vals.tolist(), strict=True):
            scored.append(TokenLogprob(token, value, dict(zip(ids, vals, strict=True)), rank))
