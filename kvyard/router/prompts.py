"""The token ids a worker will see for a request, computed in the router so it can hash them.

The same calls as the worker's front end (kvyard/server/tokenization.py, with the model's own tokenizer
and chat template), on the same single tokenizer thread. Anything that cannot be tokenized here is routed
without cache information and left to the worker to reject with a proper error.
"""

import logging
from typing import Any

from kvyard.server.tokenization import FrontendTokenizer

log = logging.getLogger(__name__)


class PromptTokenizer:
    def __init__(self, tokenizer: Any):
        self._front = FrontendTokenizer(tokenizer)

    async def token_ids(self, path: str, body: dict[str, Any]) -> list[int] | None:
        try:
            if path.endswith("/chat/completions"):
                messages = body.get("messages")
                if not isinstance(messages, list):
                    return None
                return list(await self._front.chat(messages, body.get("tools")))
            return await self._prompt(body.get("prompt"))
        except Exception as e:  # a bad request: the worker will say what is wrong with it
            log.debug("cannot tokenize a %s request: %s", path, e)
            return None

    async def output_ids(self, text: str) -> list[int]:
        """A generated text as token ids, to be scored after its prompt (no special tokens of its own)."""
        return await self._front.encode(text, add_special_tokens=False)

    async def text(self, token_ids: list[int]) -> str:
        return await self._front.decode(token_ids)

    async def _prompt(self, prompt: Any) -> list[int] | None:
        if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
            prompt = prompt[0]  # a batch of prompts: place it by the first
        if isinstance(prompt, str):
            return await self._front.encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        return None

    def close(self) -> None:
        self._front.close()
