"""`POST /v1/chat/completions`: messages through the model's chat template, streamed or not."""

import time
from collections.abc import AsyncIterator

from fastapi import Request, Response

from kvyard.errors import PromptTooLongError
from kvyard.outputs import RequestOutput
from kvyard.server.context import ServerContext
from kvyard.server.errors import APIError
from kvyard.server.generation import EngineRun, event_stream, guard_for, new_id, sampling_params
from kvyard.server.logprobs import chat_logprobs
from kvyard.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    Usage,
    read_body,
)
from kvyard.server.sse import ClientDisconnected, EventStreamResponse, run_until_disconnect, sse


async def create_chat_completion(request: Request, ctx: ServerContext) -> Response:
    arrival = time.monotonic()
    body = await read_body(request, ChatCompletionRequest)
    model = ctx.check_model(body.model)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    messages = [m.for_template() for m in body.messages]
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    with ctx.admission.admit():
        prompt = await ctx.tokenizer.chat(messages, tools)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if max_tokens is None:
            # OpenAI's default: as much as the context allows (the engine stops at the context limit).
            max_tokens = max(1, ctx.engine.max_model_len - len(prompt))
        guard = guard_for(ctx, body)
        params = sampling_params(body, max_tokens, logprobs, ctx.engine.model_config.vocab_size, guard)
        run = EngineRun(ctx, new_id("chatcmpl"), arrival, guard, streaming=bool(body.stream))
        try:
            await run.start([prompt], params)
        except PromptTooLongError as e:
            raise PromptTooLongError(str(e), param="messages") from None  # a chat request has no `prompt`
    if body.stream:
        return EventStreamResponse(_stream(ctx, run, model, body), on_close=run.close)
    try:
        with run.closing():
            response = await run_until_disconnect(request, _collect(ctx, run, model, logprobs is not None))
    except ClientDisconnected:
        return Response(status_code=499)  # nobody is listening; the engine requests are already aborted
    return Response(response.model_dump_json(), media_type="application/json")


async def _logprobs(ctx: ServerContext, out: RequestOutput, first: int) -> ChatLogprobs:
    c = out.outputs[0]
    return await chat_logprobs(ctx.tokenizer, (c.logprobs or [])[first : len(c.token_ids)])


async def _collect(ctx: ServerContext, run: EngineRun, model: str, want_logprobs: bool) -> ChatCompletionResponse:
    finals: dict[int, RequestOutput] = {}
    async for choice, out in run.outputs():
        if out.finished:
            finals[choice.index] = out
    choices = [
        ChatChoice(
            index=i,
            message=AssistantMessage(content=out.outputs[0].text),
            logprobs=await _logprobs(ctx, out, 0) if want_logprobs else None,
            finish_reason=out.outputs[0].finish_reason,
        )
        for i, out in sorted(finals.items())
    ]
    return ChatCompletionResponse(id=run.request_id, created=int(time.time()), model=model, choices=choices,
                                  usage=Usage(**run.usage()))


def _stream(ctx: ServerContext, run: EngineRun, model: str, body: ChatCompletionRequest) -> AsyncIterator[str]:
    created = int(time.time())
    want_logprobs = bool(body.logprobs)
    sent_tokens: dict[int, int] = {}

    def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
        return sse(ChatCompletionChunk(id=run.request_id, created=created, model=model, choices=choices,
                                       usage=usage).model_dump())

    async def events() -> AsyncIterator[str]:
        # OpenAI opens every choice with the role, before any content.
        for choice in sorted(run.choices.values(), key=lambda c: c.index):
            yield chunk([ChatChunkChoice(index=choice.index, delta=ChatDelta(role="assistant", content=""))])
        async for choice, out in run.outputs():
            c = out.outputs[0]
            if not (c.delta_text or out.finished or (want_logprobs and c.delta_token_ids)):
                continue  # e.g. half a UTF-8 character, held back by the detokenizer
            lps = None
            if want_logprobs:
                lps = await _logprobs(ctx, out, sent_tokens.get(choice.index, 0))
                sent_tokens[choice.index] = len(c.token_ids)
            delta = ChatDelta(content=c.delta_text) if c.delta_text else ChatDelta()
            finish = c.finish_reason if out.finished else None
            yield chunk([ChatChunkChoice(index=choice.index, delta=delta, logprobs=lps, finish_reason=finish)])

    usage = (lambda: chunk([], Usage(**run.usage()))) if body.include_usage else None
    return event_stream(run, events(), usage)
