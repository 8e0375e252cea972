"""`POST /v1/completions`: text or token prompts, one or many, streamed or not."""

import time
from collections.abc import AsyncIterator
from dataclasses import replace

from fastapi import Request, Response

from kvyard.errors import InvalidRequestError
from kvyard.outputs import RequestOutput
from kvyard.server.context import ServerContext
from kvyard.server.errors import APIError
from kvyard.server.generation import (
    MAX_CHOICES,
    Choice,
    EngineRun,
    event_stream,
    guard_for,
    new_id,
    sampling_params,
)
from kvyard.server.logprobs import completion_logprobs
from kvyard.server.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    PromptInput,
    Usage,
    read_body,
)
from kvyard.server.sse import ClientDisconnected, EventStreamResponse, run_until_disconnect, sse
from kvyard.server.structured import requested_output

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for this endpoint


async def create_completion(request: Request, ctx: ServerContext) -> Response:
    arrival = time.monotonic()
    body = await read_body(request, CompletionRequest)
    model = ctx.check_model(body.model)
    _reject_unsupported(body)
    max_tokens = DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    guard = guard_for(ctx, body)
    params = sampling_params(body, max_tokens, body.logprobs, ctx.engine.model_config.vocab_size, guard)
    constraint = requested_output(body)
    with ctx.admission.admit():
        if constraint is not None:  # compiled here, off the engine thread (kvyard/server/structured.py)
            params = replace(params, structured_output=await ctx.grammars.compile(constraint))
        prompts = await _prompt_ids(ctx, body.prompt)
        run = EngineRun(ctx, new_id("cmpl"), arrival, guard, streaming=bool(body.stream))
        await run.start(prompts, params, body.kv_transfer_params)
    if body.stream:
        return EventStreamResponse(_stream(ctx, run, model, body), on_close=run.close)
    try:
        with run.closing():
            response = await run_until_disconnect(request, _collect(ctx, run, model, body))
    except ClientDisconnected:
        return Response(status_code=499)  # nobody is listening; the engine requests are already aborted
    return Response(response.model_dump_json(), media_type="application/json")


def _reject_unsupported(body: CompletionRequest) -> None:
    # Silently ignoring these would return something other than what was asked for.
    if body.echo:
        raise APIError(400, "echo is not supported", param="echo")
    if body.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    if body.best_of is not None and body.best_of != (body.n or 1):
        raise APIError(400, "best_of is not supported (it must equal n)", param="best_of")


async def _prompt_ids(ctx: ServerContext, prompt: PromptInput) -> list[list[int]]:
    if isinstance(prompt, str):
        return [await ctx.tokenizer.encode(prompt)]
    if not prompt:
        raise InvalidRequestError("the prompt is empty", param="prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]  # type: ignore[arg-type]
    if len(prompt) > MAX_CHOICES:
        raise InvalidRequestError(f"at most {MAX_CHOICES} prompts per request", param="prompt")
    if isinstance(prompt[0], list):
        return [list(p) for p in prompt]  # type: ignore[union-attr]
    return [await ctx.tokenizer.encode(p) for p in prompt]  # type: ignore[arg-type]


async def _choice(ctx: ServerContext, out: RequestOutput, index: int, logprobs: bool,
                  text: str, first_token: int, text_offset: int) -> CompletionChoice:
    c = out.outputs[0]
    lps = None
    if logprobs:
        lps = await completion_logprobs(ctx.tokenizer, (c.logprobs or [])[first_token : len(c.token_ids)], text_offset)
    return CompletionChoice(index=index, text=text, logprobs=lps, finish_reason=c.finish_reason)


async def _collect(ctx: ServerContext, run: EngineRun, model: str, body: CompletionRequest) -> CompletionResponse:
    finals: dict[int, RequestOutput] = {}
    async for choice, out in run.outputs():
        if out.finished:
            finals[choice.index] = out
    want_logprobs = body.logprobs is not None
    choices = [await _choice(ctx, finals[i], i, want_logprobs, finals[i].outputs[0].text, 0, 0) for i in sorted(finals)]
    return CompletionResponse(id=run.request_id, created=int(time.time()), model=model, choices=choices,
                              usage=Usage(**run.usage()))


def _stream(ctx: ServerContext, run: EngineRun, model: str, body: CompletionRequest) -> AsyncIterator[str]:
    created = int(time.time())
    want_logprobs = body.logprobs is not None
    sent_tokens: dict[int, int] = {}  # per choice: tokens whose logprobs were sent
    sent_chars: dict[int, int] = {}

    def chunk(choices: list[CompletionChoice], usage: Usage | None = None) -> str:
        return sse(CompletionResponse(id=run.request_id, created=created, model=model, choices=choices,
                                      usage=usage).model_dump())

    async def events() -> AsyncIterator[str]:
        async for choice, out in run.outputs():
            c = out.outputs[0]
            if not (c.delta_text or out.finished or (want_logprobs and c.delta_token_ids)):
                continue  # e.g. half a UTF-8 character, held back by the detokenizer
            yield chunk([await _delta_choice(ctx, choice, out, want_logprobs, sent_tokens, sent_chars)])

    usage = (lambda: chunk([], Usage(**run.usage()))) if body.include_usage else None
    return event_stream(run, events(), usage)


async def _delta_choice(ctx: ServerContext, choice: Choice, out: RequestOutput, want_logprobs: bool,
                        sent_tokens: dict[int, int], sent_chars: dict[int, int]) -> CompletionChoice:
    c = out.outputs[0]
    first = sent_tokens.get(choice.index, 0)
    offset = sent_chars.get(choice.index, 0)
    part = await _choice(ctx, out, choice.index, want_logprobs, c.delta_text, first, offset)
    sent_tokens[choice.index] = len(c.token_ids)
    sent_chars[choice.index] = offset + len(c.delta_text)
    if not out.finished:
        part.finish_reason = None
    return part
