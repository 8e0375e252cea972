"""`POST /v1/chat/completions`: messages through the model's chat template, streamed or not.

With `tools`, the conversation is rendered and the calls constrained as kvyard/server/tools.py says, and
the answer is read back into `tool_calls` (kvyard/server/tools_parser.py). Output constraints
(`response_format`, ...) are compiled before the request reaches the engine (kvyard/server/structured.py).
"""

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import replace

from fastapi import Request, Response

from kvyard.errors import InvalidRequestError, PromptTooLongError
from kvyard.outputs import RequestOutput
from kvyard.server.context import ServerContext
from kvyard.server.errors import APIError
from kvyard.server.generation import (
    EngineRun,
    default_max_tokens,
    event_stream,
    guard_for,
    new_id,
    sampling_params,
)
from kvyard.server.logprobs import chat_logprobs, prompt_logprobs
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
from kvyard.server.structured import requested_output
from kvyard.server.tools import ToolPlan
from kvyard.server.tools_parser import ToolCallStream, message_parts
from kvyard.structured.spec import StructuredOutput
from kvyard.vision.images import MAX_IMAGES, RequestImage, image_from_url


async def create_chat_completion(request: Request, ctx: ServerContext) -> Response:
    arrival = time.monotonic()
    body = await read_body(request, ChatCompletionRequest)
    model = ctx.check_model(body.model)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    if body.stream and body.prompt_logprobs is not None:
        raise APIError(400, "prompt_logprobs are not available when stream is true (as in vLLM)",
                       param="prompt_logprobs")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    tools = ToolPlan.from_request(body, ctx.engine.tokenizer.chat_template)
    constraint = requested_output(body)
    if tools.active and constraint is not None:
        raise InvalidRequestError(
            "an output constraint cannot be combined with tools unless tool_choice is none", param=constraint.param
        )
    images = _images(ctx, body, model)
    marker = ctx.vision.placeholder if ctx.vision is not None else "<image>"
    messages = tools.render([m.for_template(marker) for m in body.messages])
    with ctx.admission.admit():
        constraint = await _compile(ctx, tools, constraint)
        soft = None
        if images:
            assert ctx.vision is not None
            pieces = await ctx.tokenizer.chat_pieces(messages, tools.template_tools(), marker)
            prompt, soft = await asyncio.to_thread(ctx.vision.prompt, pieces, images)
        else:
            prompt = await ctx.tokenizer.chat(messages, tools.template_tools())
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if max_tokens is None:
            # OpenAI's default: as much as the context allows (the engine stops at the context limit).
            max_tokens = default_max_tokens(ctx.generation_defaults, max(1, ctx.engine.max_model_len - len(prompt)))
        guard = guard_for(ctx, body)
        params = sampling_params(body, max_tokens, logprobs, ctx.engine.model_config.vocab_size, guard,
                                 ctx.generation_defaults, body.prompt_logprobs)
        if constraint is not None:
            params = replace(params, structured_output=constraint)
        run = EngineRun(ctx, new_id("chatcmpl"), arrival, guard, streaming=bool(body.stream),
                        lora=ctx.adapter_of(model), soft_tokens=soft)
        try:
            await run.start([prompt], params, body.kv_transfer_params)
        except PromptTooLongError as e:
            raise PromptTooLongError(str(e), param="messages") from None  # a chat request has no `prompt`
    if body.stream:
        return EventStreamResponse(_stream(ctx, run, model, body, tools.active), on_close=run.close)
    try:
        with run.closing():
            response = await run_until_disconnect(request, _collect(ctx, run, model, logprobs is not None,
                                                                    tools.active, body.prompt_logprobs))
    except ClientDisconnected:
        return Response(status_code=499)  # nobody is listening; the engine requests are already aborted
    return Response(response.model_dump_json(), media_type="application/json")


def _images(ctx: ServerContext, body: ChatCompletionRequest, model: str) -> list[RequestImage]:
    """The request's images, checked (not yet decoded); a 400 where the model takes none or there are too many."""
    urls = [url for m in body.messages for url in m.image_urls()]
    if not urls:
        return []
    if ctx.vision is None:
        raise APIError(400, f"the model {model} takes no images: serve a vision graft (kvyard graft vision) for "
                            f"image_url parts", param="messages")
    if len(urls) > MAX_IMAGES:
        raise APIError(400, f"at most {MAX_IMAGES} images per request, got {len(urls)}", param="messages")
    if body.kv_transfer_params is not None:
        raise APIError(400, "images cannot take prefill/decode disaggregation's KV transfer yet",
                       param="kv_transfer_params")
    return [image_from_url(url) for url in urls]


async def _compile(ctx: ServerContext, tools: ToolPlan,
                   constraint: StructuredOutput | None) -> StructuredOutput | None:
    """The request's grammar, compiled; each tool's parameters are checked alone so a 400 names the tool."""
    if not tools.active:
        return await ctx.grammars.compile(constraint)
    for param, schema in tools.parameter_schemas():
        await ctx.grammars.compile(StructuredOutput.json_schema(schema, param=param))
    return await ctx.grammars.compile(tools.constraint())


def _finish_reason(reason: str | None, has_calls: bool) -> str | None:
    return "tool_calls" if has_calls and reason == "stop" else reason


async def _logprobs(ctx: ServerContext, out: RequestOutput, first: int) -> ChatLogprobs:
    c = out.outputs[0]
    return await chat_logprobs(ctx.tokenizer, (c.logprobs or [])[first : len(c.token_ids)])


async def _collect(ctx: ServerContext, run: EngineRun, model: str, want_logprobs: bool,
                   with_tools: bool, prompt_top: int | None = None) -> ChatCompletionResponse:
    finals: dict[int, RequestOutput] = {}
    async for choice, out in run.outputs():
        if out.finished:
            finals[choice.index] = out
    choices = []
    for i, out in sorted(finals.items()):
        c = out.outputs[0]
        content, calls = message_parts(c.text) if with_tools else (c.text, None)
        choices.append(ChatChoice(
            index=i,
            message=AssistantMessage(content=content, tool_calls=calls),
            logprobs=await _logprobs(ctx, out, 0) if want_logprobs else None,
            finish_reason=_finish_reason(c.finish_reason, bool(calls)),
        ))
    scored = None
    if prompt_top is not None:  # one conversation for every choice: the first choice's scoring says it all
        scored = await prompt_logprobs(ctx.tokenizer, finals[min(finals)].prompt_logprobs or [], prompt_top)
    return ChatCompletionResponse(id=run.request_id, created=int(time.time()), model=model, choices=choices,
                                  usage=Usage(**run.usage()), prompt_logprobs=scored)


def _stream(ctx: ServerContext, run: EngineRun, model: str, body: ChatCompletionRequest,
            with_tools: bool) -> AsyncIterator[str]:
    created = int(time.time())
    want_logprobs = bool(body.logprobs)
    sent_tokens: dict[int, int] = {}
    tool_streams: dict[int, ToolCallStream] = {}

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
            if with_tools:
                calls = tool_streams.setdefault(choice.index, ToolCallStream())
                content, call_deltas = calls.update(c.text, out.finished)
                delta = ChatDelta(content=content or None, tool_calls=call_deltas or None)
                if finish is not None:
                    finish = _finish_reason(finish, calls.num_complete > 0)
                elif not (content or call_deltas or (want_logprobs and c.delta_token_ids)):
                    continue  # held back: it may be the start of a tool call
            yield chunk([ChatChunkChoice(index=choice.index, delta=delta, logprobs=lps, finish_reason=finish)])

    usage = (lambda: chunk([], Usage(**run.usage()))) if body.include_usage else None
    return event_stream(run, events(), usage)
