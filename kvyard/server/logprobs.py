"""Engine logprobs (`TokenLogprob`) in the shapes clients read: OpenAI's legacy completions and chat,
and vLLM's `prompt_logprobs`."""

from collections.abc import Sequence

from kvyard.outputs import TokenLogprob
from kvyard.server.protocol import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
    TopLogprob,
)
from kvyard.server.tokenization import FrontendTokenizer


async def completion_logprobs(
    tokenizer: FrontendTokenizer, logprobs: Sequence[TokenLogprob], text_offset: int
) -> CompletionLogprobs:
    """`text_offset` is where the first of these tokens starts in the completion's text."""
    ids = [lp.token_id for lp in logprobs] + [t for lp in logprobs for t in lp.top]
    texts = dict(zip(ids, await tokenizer.token_texts(ids), strict=True))
    out = CompletionLogprobs()
    for lp in logprobs:
        text = texts[lp.token_id]
        out.tokens.append(text)
        out.token_logprobs.append(lp.logprob)
        out.top_logprobs.append({texts[t]: v for t, v in lp.top.items()})
        out.text_offset.append(text_offset)
        text_offset += len(text)
    return out


async def chat_logprobs(tokenizer: FrontendTokenizer, logprobs: Sequence[TokenLogprob]) -> ChatLogprobs:
    ids = [lp.token_id for lp in logprobs] + [t for lp in logprobs for t in lp.top]
    texts = dict(zip(ids, await tokenizer.token_texts(ids), strict=True))

    def entry(token_id: int, logprob: float) -> TopLogprob:
        text = texts[token_id]
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))

    content = [
        ChatTokenLogprob(**entry(lp.token_id, lp.logprob).model_dump(),
                         top_logprobs=[entry(t, v) for t, v in lp.top.items()])
        for lp in logprobs
    ]
    return ChatLogprobs(content=content)


async def echo_logprobs(tokenizer: FrontendTokenizer, prompt_ids: Sequence[int],
                        scored: Sequence[TokenLogprob | None], top_n: int) -> CompletionLogprobs:
    """The prompt's part of an echoed completion's logprobs: the first token has none (null), as in OpenAI."""
    ids = list(prompt_ids) + [t for lp in scored if lp is not None for t in lp.top]
    texts = dict(zip(ids, await tokenizer.token_texts(ids), strict=True))
    out = CompletionLogprobs()
    offset = 0
    for token, lp in zip(prompt_ids, scored, strict=True):
        out.tokens.append(texts[token])
        out.token_logprobs.append(None if lp is None else lp.logprob)
        top = None if lp is None else list(lp.top.items())[:top_n]  # the engine scored the larger of two asks
        out.top_logprobs.append(None if top is None else {texts[t]: v for t, v in top})
        out.text_offset.append(offset)
        offset += len(texts[token])
    return out


async def prompt_logprobs(tokenizer: FrontendTokenizer, scored: Sequence[TokenLogprob | None],
                          top_n: int) -> PromptLogprobs:
    """vLLM's `prompt_logprobs`: per prompt token, its own entry first, then the top-n (each with its rank)."""
    ids = [t for lp in scored if lp is not None for t in (lp.token_id, *lp.top)]
    texts = dict(zip(ids, await tokenizer.token_texts(ids), strict=True))
    out: PromptLogprobs = []
    for lp in scored:
        if lp is None:
            out.append(None)
            continue
        entry = {str(lp.token_id): PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=texts[lp.token_id])}
        for rank, (t, v) in enumerate(list(lp.top.items())[:top_n], start=1):
            entry.setdefault(str(t), PromptLogprob(logprob=v, rank=rank, decoded_token=texts[t]))
        out.append(entry)
    return out
