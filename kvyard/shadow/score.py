"""Teacher-forced scoring through a deployment's own API: the distributions it gives at each of a response's
tokens, read from vLLM's `prompt_logprobs` on /v1/completions (the prompt and the response sent as one token-id
prompt, one token generated). Any server with that field can be scored, kvyard or not."""

from typing import Any

import httpx

from kvyard.shadow.compare import Dist

TOP = 20  # logprobs per position: the most vLLM and kvyard return


async def score_tokens(client: httpx.AsyncClient, url: str, model: str | None, prompt_ids: list[int],
                       output_ids: list[int], top: int = TOP) -> list[Dist]:
    """Per token of `output_ids`: the deployment at `url`'s logprobs of its top-`top` tokens (and of that token)
    there. `model`: None lets the server use its own."""
    body: dict[str, Any] = {"prompt": prompt_ids + output_ids, "max_tokens": 1, "temperature": 0.0,
                            "prompt_logprobs": top}
    if model is not None:
        body["model"] = model
    r = await client.post(url.rstrip("/") + "/v1/completions", json=body)
    r.raise_for_status()
    answer = r.json()
    entries = answer.get("prompt_logprobs") or answer["choices"][0].get("prompt_logprobs")
    if not entries or len(entries) != len(prompt_ids) + len(output_ids):
        raise ValueError(f"{url} returned no prompt_logprobs for the {len(output_ids)} tokens scored")
    start = len(prompt_ids)
    return [{int(t): float(v["logprob"]) for t, v in entries[start + j].items()} for j in range(len(output_ids))]
