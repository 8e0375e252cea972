"""`POST /v1/completions`: text or token prompts, one or many, streamed or not.

`echo` puts each prompt's text before its choice's text (and, with `logprobs`, the prompt tokens' logprobs
before the output's, the first prompt token's null); vLLM's `prompt_logprobs` adds them in vLLM's shape.
Both come from the engine's prompt scoring (kvyard/engine/prompt_logprobs.py).
"""

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
    default_max_tokens,
    event_stream,
    guard_for,
    new_id,
    sampling_params,
)
from kvyard.server.logprobs import completion_logprobs, echo_logprobs, prompt_logprobs
from kvyard.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
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
    max_tokens = default_max_tokens(ctx.generation_defaults, DEFAULT_MAX_TOKENS) if body.max_tokens is None \
        else body.max_tokens
    guard = guard_for(ctx, body)
    params = sampling_params(body, max_tokens, body.logprobs, ctx.engine.model_config.vocab_size, guard,
                             ctx.generation_defaults, _prompt_logprobs_to_score(body))
    constraint = requested_output(body)
    with ctx.admission.admit():
        if constraint is not None:  # compiled here, off the engine thread (kvyard/server/structured.py)
            params = replace(params, structured_output=await ctx.grammars.compile(constraint))
        prompts = await _prompt_ids(ctx, body.prompt)
        echoes = await _echo_texts(ctx, body, prompts)
        run = EngineRun(ctx, new_id("cmpl"), arrival, guard, streaming=bool(body.stream),
                        lora=ctx.adapter_of(model))
        await run.start(prompts, params, body.kv_transfer_params)
    if body.stream:
        return EventStreamResponse(_stream(ctx, run, model, body, echoes), on_close=run.close)
    try:
        with run.closing():
            response = await run_until_disconnect(request, _collect(ctx, run, model, body, echoes))
    except ClientDisconnected:
        return Response(status_code=499)  # nobody is listening; the engine requests are already aborted
    return Response(response.model_dump_json(), media_type="application/json")


def _reject_unsupported(body: CompletionRequest) -> None:
    # Silently ignoring these would return something other than what was asked for.
    if body.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    if body.best_of is not None and body.best_of != (body.n or 1):
        raise APIError(400, "best_of is not supported (it must equal n)", param="best_of")
    if body.stream and body.prompt_logprobs is not None:
        raise APIError(400, "prompt_logprobs are not available when stream is true (as in vLLM)",
                       param="prompt_logprobs")


def _prompt_logprobs_to_score(body: CompletionRequest) -> int | None:
    """How many alternatives the engine scores per prompt token: for prompt_logprobs, for an echo with
    logprobs, or the larger of the two when both are asked (each answer takes its own top-n)."""
    asks = [n for n in (body.prompt_logprobs, body.logprobs if body.echo else None) if n is not None]
    return max(asks) if asks else None


async def _echo_texts(ctx: ServerContext, body: CompletionRequest, prompts: list[list[int]]) -> list[str] | None:
    """Each prompt's text for `echo`: as sent, or decoded when it was sent as token ids."""
    if not body.echo:
        return None
    if isinstance(body.prompt, str):
        return [body.prompt]
    if body.prompt and isinstance(body.prompt[0], str):
        return list(body.prompt)  # type: ignore[arg-type]
    return [await ctx.tokenizer.decode(ids) for ids in prompts]


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


async def _choice(ctx: ServerContext, body: CompletionRequest, out: RequestOutput, index: int, text: str,
                  first_token: int, text_offset: int, echo: str | None = None) -> CompletionChoice:
    """A choice with `text` and the logprobs of its tokens from `first_token` (which start at `text_offset`);
    with `echo`, the prompt's text and logprobs come first."""
    c = out.outputs[0]
    lps = None
    if body.logprobs is not None:
        lps = CompletionLogprobs()
        if echo is not None:
            lps = await echo_logprobs(ctx.tokenizer, out.prompt_token_ids, out.prompt_logprobs or [], body.logprobs)
            text_offset += len(echo)
        lps.extend(await completion_logprobs(ctx.tokenizer, (c.logprobs or [])[first_token : len(c.token_ids)],
                                             text_offset))
    return CompletionChoice(index=index, text=text if echo is None else echo + text, logprobs=lps,
                            finish_reason=c.finish_reason)


async def _collect(ctx: ServerContext, run: EngineRun, model: str, body: CompletionRequest,
                   echoes: list[str] | None) -> CompletionResponse:
    finals: dict[int, tuple[Choice, RequestOutput]] = {}
    async for choice, out in run.outputs():
        if out.finished:
            finals[choice.index] = (choice, out)
    choices = []
    for i, (choice, out) in sorted(finals.items()):
        echo = None if echoes is None else echoes[choice.prompt_index]
        part = await _choice(ctx, body, out, i, out.outputs[0].text, 0, 0, echo)
        if body.prompt_logprobs is not None:
            part.prompt_logprobs = await prompt_logprobs(ctx.tokenizer, out.prompt_logprobs or [], body.prompt_logprobs)
        choices.append(part)
    return CompletionResponse(id=run.request_id, created=int(time.time()), model=model, choices=choices,
                              usage=Usage(**run.usage()))


def _stream(ctx: ServerContext, run: EngineRun, model: str, body: CompletionRequest,
            echoes: list[str] | None) -> AsyncIterator[str]:
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
            echo = None if echoes is None or choice.index in sent_chars else echoes[choice.prompt_index]
            yield chunk([await _delta_choice(ctx, body, choice, out, sent_tokens, sent_chars, echo)])

    usage = (lambda: chunk([], Usage(**run.usage()))) if body.include_usage else None
    return event_stream(run, events(), usage)


async def _delta_choice(ctx: ServerContext, body: CompletionRequest, choice: Choice, out: RequestOutput,
                        sent_tokens: dict[int, int], sent_chars: dict[int, int], echo: str | None) -> CompletionChoice:
    c = out.outputs[0]
    first = sent_tokens.get(choice.index, 0)
    offset = sent_chars.get(choice.index, 0)
    part = await _choice(ctx, body, out, choice.index, c.delta_text, first, offset, echo)
    sent_tokens[choice.index] = len(c.token_ids)
    sent_chars[choice.index] = offset + len(part.text)  # an echo's prompt counts: offsets are into the whole
    if not out.finished:
        part.finish_reason = None
    return part
