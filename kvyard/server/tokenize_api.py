"""vLLM's `POST /tokenize` and `POST /detokenize`, with vLLM's request and response shapes.

A client counts tokens, or checks what a prompt or a conversation becomes, with the server's own
tokenizer and chat template. The defaults give exactly what the generation endpoints would feed the
engine: a `prompt` gets the tokenizer's special tokens (as /v1/completions does), `messages` only what
the template writes (as /v1/chat/completions does, without tools).
"""

from fastapi import FastAPI, Request, Response
from pydantic import Field, StrictBool, StrictStr

from kvyard.server.context import ServerContext
from kvyard.server.errors import APIError
from kvyard.server.protocol import ChatMessage, OpenAIModel, TokenId, read_body


class TokenizeRequest(OpenAIModel):
    """Either `prompt` (vLLM's TokenizeCompletionRequest) or `messages` (its TokenizeChatRequest)."""

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: StrictBool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    return_token_strs: StrictBool = False


class TokenizeResponse(OpenAIModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIModel):
    model: StrictStr | None = None
    tokens: list[TokenId]


class DetokenizeResponse(OpenAIModel):
    prompt: str


def _json(model: OpenAIModel) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")


async def tokenize(request: Request, ctx: ServerContext) -> Response:
    body = await read_body(request, TokenizeRequest)
    ctx.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of prompt and messages", param="prompt")
    if body.prompt is not None:
        special = True if body.add_special_tokens is None else body.add_special_tokens
        tokens = await ctx.tokenizer.encode(body.prompt, add_special_tokens=special)
    else:
        assert body.messages is not None
        tokens = await ctx.tokenizer.chat([m.for_template() for m in body.messages], None,
                                          add_generation_prompt=body.add_generation_prompt,
                                          continue_final_message=body.continue_final_message,
                                          add_special_tokens=bool(body.add_special_tokens))
    strs = await ctx.tokenizer.token_strs(tokens) if body.return_token_strs else None
    return _json(TokenizeResponse(count=len(tokens), max_model_len=ctx.engine.max_model_len, tokens=tokens,
                                  token_strs=strs))


async def detokenize(request: Request, ctx: ServerContext) -> Response:
    body = await read_body(request, DetokenizeRequest)
    ctx.check_model(body.model)
    vocab = ctx.engine.model_config.vocab_size
    bad = [t for t in body.tokens if t >= vocab]
    if bad:
        raise APIError(400, f"tokens: {bad[0]} is not a token id of this model (0 to {vocab - 1})", param="tokens")
    return _json(DetokenizeResponse(prompt=await ctx.tokenizer.decode(body.tokens)))


def install_tokenize_routes(app: FastAPI, ctx: ServerContext) -> None:
    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> Response:
        return await tokenize(request, ctx)

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> Response:
        return await detokenize(request, ctx)
