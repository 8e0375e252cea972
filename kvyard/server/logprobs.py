"""Engine logprobs (`TokenLogprob`) in the two shapes OpenAI uses: legacy completions and chat."""

from collections.abc import Sequence

from kvyard.outputs import TokenLogprob
from kvyard.server.protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob
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
