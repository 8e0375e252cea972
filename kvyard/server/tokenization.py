"""The front end's tokenizer work, off the event loop and on one thread.

Chat templates and long prompts take milliseconds the event loop should spend streaming. HF fast
tokenizers are not safe to call from several threads at once ("Already borrowed"), so every call goes
through one single-thread executor, and the tokenizer is the front end's own copy (the engine thread
detokenizes with its own).
"""

import asyncio
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvyard.errors import InvalidRequestError


class FrontendTokenizer:
    def __init__(self, tokenizer: Any):
        self._tok = tokenizer
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvyard-tokenizer")
        self._token_text: dict[int, str] = {}

    async def _call(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def run(self, fn: Any) -> Any:
        """`fn(tokenizer)` on the tokenizer's thread, for other readers of it (the grammar compiler)."""
        return await self._call(fn, self._tok)

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # By default the same call LLMEngine.tokenize makes, so a text prompt means the same tokens either way.
        return await self._call(lambda: self._tok(text, add_special_tokens=add_special_tokens).input_ids)

    async def decode(self, token_ids: Sequence[int]) -> str:
        return await self._call(lambda: self._tok.decode(list(token_ids)))

    def _render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                add_generation_prompt: bool = True, continue_final_message: bool = False) -> str:
        """The conversation through the chat template, as text (on the tokenizer's thread)."""
        if self._tok.chat_template is None:
            raise InvalidRequestError("this model has no chat template; use /v1/completions", param="messages")
        kwargs: dict[str, Any] = {"tools": tools} if tools else {}
        try:
            return self._tok.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                continue_final_message=continue_final_message, **kwargs
            )
        except Exception as e:
            # Templates reject conversations they cannot express (roles out of order, a tool call
            # where the template expects text, ...): that is the request's fault, hence a 400.
            raise InvalidRequestError(f"the chat template rejected the messages: {e}", param="messages") from e

    async def chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                   add_generation_prompt: bool = True, continue_final_message: bool = False,
                   add_special_tokens: bool = False) -> list[int]:
        """The conversation through the chat template, as token ids. The template writes its own special
        tokens, so the rendered text is encoded without adding more unless asked (/tokenize's option)."""
        def render() -> list[int]:
            # What apply_chat_template(tokenize=True) does, with the choice of special tokens left open.
            text = self._render(messages, tools, add_generation_prompt, continue_final_message)
            return self._tok(text, add_special_tokens=add_special_tokens).input_ids

        return await self._call(render)

    async def chat_pieces(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                          marker: str) -> list[list[int]]:
        """The templated conversation cut at each `marker` (an image's place), each piece as token ids."""
        def render() -> list[list[int]]:
            pieces = self._render(messages, tools).split(marker)
            return [self._tok(p, add_special_tokens=False).input_ids for p in pieces]

        return await self._call(render)

    async def token_texts(self, token_ids: Sequence[int]) -> list[str]:
        """Each token's own text (for logprobs), cached: a vocabulary is small, requests are many."""
        missing = [t for t in set(token_ids) if t not in self._token_text]
        if missing:
            texts = await self._call(lambda: [self._tok.decode([t]) for t in missing])
            self._token_text.update(zip(missing, texts, strict=True))
        return [self._token_text[t] for t in token_ids]

    async def token_strs(self, token_ids: Sequence[int]) -> list[str]:
        """The vocabulary's own strings of these tokens (byte-level, e.g. "Ġthe"), as vLLM's /tokenize gives."""
        return await self._call(lambda: self._tok.convert_ids_to_tokens(list(token_ids)))

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
