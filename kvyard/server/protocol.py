"""Request bodies of the OpenAI API (completions, chat completions), plus vLLM's sampling extensions.

Types are strict: `"max_tokens": "5"` or `true` for an integer is a 400, not a silent coercion. Unknown
fields are accepted and ignored, because OpenAI clients send fields we do not implement (`service_tier`,
`metadata`, ...). Ranges are left to `SamplingParams.validate`, the one place that defines them, except
for what only the server knows (which parameters exist only on one endpoint, bounds of the wire format).
"""

import json
from typing import Annotated, Any, Literal, TypeVar

from fastapi import Request
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    model_serializer,
    model_validator,
)

from kvyard.server.errors import APIError

Int64 = Annotated[StrictInt, Field(ge=-(2**63), le=2**63 - 1)]
TokenId = Annotated[StrictInt, Field(ge=0, le=2**31 - 1)]
Count = Annotated[StrictInt, Field(le=2**31 - 1)]  # anything larger is a typo, and overflows torch tensors
MaxTokens = Annotated[StrictInt, Field(ge=1, le=2**31 - 1)]


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class StreamOptions(OpenAIModel):
    include_usage: StrictBool | None = False


class RepetitionGuardFields(BaseModel):
    """kvyard's per-request `repetition_guard` (kvyard/server/repetition.py); unset fields keep the deployment's."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # a typo here would silently do nothing

    action: Literal["off", "stop", "retry"] | None = None
    max_retries: Count | None = None
    retry_repetition_penalty: StrictFloat | None = None
    min_count: Count | None = None
    min_pattern_size: Count | None = None
    max_pattern_size: Count | None = None
    plain_min_tokens: Count | None = None
    text_min_count: Count | None = None
    text_max_period: Count | None = None


class VLLMRepetitionDetection(OpenAIModel):
    """vLLM's `repetition_detection`: token n-grams of max_pattern_size (0: off) repeated min_count times."""

    max_pattern_size: Count = 0
    min_pattern_size: Count = 0
    min_count: Count = 0


class JSONSchemaFormat(OpenAIModel):
    name: StrictStr | None = None
    description: StrictStr | None = None
    # `schema` would shadow a BaseModel attribute; the alias keeps the wire name.
    json_schema: dict[str, Any] | StrictBool | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(OpenAIModel):
    """OpenAI's `response_format`: free text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsFields(OpenAIModel):
    """vLLM's `structured_outputs` object: exactly one of these constrains the output."""

    json_: dict[str, Any] | StrictStr | StrictBool | None = Field(default=None, alias="json")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = None
    json_object: StrictBool | None = None


class KVTransferParams(OpenAIModel):
    """A prefill worker's answer to POST /kv/prefill, passed on to the decode worker by the router."""

    transfer_id: StrictStr
    endpoint: StrictStr  # tcp://host:port of the prefill worker's KV source
    num_blocks: Annotated[StrictInt, Field(ge=0)]


class SamplingFields(OpenAIModel):
    """Fields both endpoints share; None means "not given", so the SamplingParams default applies."""

    model: StrictStr | None = None
    max_tokens: MaxTokens | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    n: Count | None = None
    stop: StrictStr | list[StrictStr] | None = None
    seed: Int64 | None = None
    presence_penalty: StrictFloat | None = None
    frequency_penalty: StrictFloat | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    # token id (as a string, OpenAI's wire form) -> bias in [-100, 100]; checked in generation.sampling_params
    logit_bias: dict[StrictStr, StrictFloat] | None = None
    # vLLM extensions
    top_k: Count | None = None
    min_p: StrictFloat | None = None
    repetition_penalty: StrictFloat | None = None
    ignore_eos: StrictBool | None = None
    min_tokens: Count | None = None
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: StrictBool | None = None
    repetition_detection: VLLMRepetitionDetection | None = None
    prompt_logprobs: Count | None = None  # per prompt token: its logprob and the top-n (not with stream)
    # kvyard extension
    repetition_guard: RepetitionGuardFields | None = None
    # Structured output (kvyard/server/structured.py): OpenAI's response_format, vLLM's guided_* and
    # structured_outputs. At most one may be set.
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | StrictStr | StrictBool | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    structured_outputs: StructuredOutputsFields | None = None
    # Prefill/decode disaggregation (vLLM's field name): where this request's prompt KV waits to be pulled.
    # The router sets it; kvyard/server/disagg.py reads it.
    kv_transfer_params: KVTransferParams | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


PromptInput = StrictStr | list[StrictStr] | list[TokenId] | list[list[TokenId]]


class CompletionRequest(SamplingFields):
    prompt: PromptInput
    logprobs: Count | None = None
    echo: StrictBool | None = False
    suffix: StrictStr | None = None
    best_of: Count | None = None


class ImageURL(OpenAIModel):
    url: StrictStr  # a data URL (kvyard/vision/images.py): remote ones are refused, nothing is fetched
    detail: Literal["auto", "low", "high"] | None = None


class ContentPart(OpenAIModel):
    type: StrictStr
    text: StrictStr | None = None
    image_url: ImageURL | None = None

    @model_validator(mode="after")
    def _known_type(self) -> "ContentPart":
        if self.type not in ("text", "image_url"):
            raise ValueError(f"only text and image_url content parts are supported, got type {self.type!r}")
        if self.type == "text" and self.text is None:
            raise ValueError("a text part needs text")
        if self.type == "image_url" and self.image_url is None:
            raise ValueError("an image_url part needs image_url")
        return self


class FunctionCall(OpenAIModel):
    name: StrictStr
    arguments: StrictStr


class ToolCall(OpenAIModel):
    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[ContentPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: StrictStr | None = None

    @model_validator(mode="after")
    def _role_rules(self) -> "ChatMessage":
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs tool_call_id")
        if self.image_urls() and self.role != "user":
            raise ValueError(f"images go in user messages, not {self.role} ones")
        return self

    def image_urls(self) -> list[str]:
        """The URLs of its image parts, in order."""
        if not isinstance(self.content, list):
            return []
        return [part.image_url.url for part in self.content if part.image_url is not None]

    def for_template(self, image_marker: str = "<image>") -> dict[str, Any]:
        """The dict a chat template sees: parts joined by newlines, each image as `image_marker` (a vision graft's
        placeholder, where its soft tokens go), `developer` as `system`, nothing unset."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(image_marker if part.type == "image_url" else part.text or "" for part in content)
        msg: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": content}
        if self.name is not None:
            msg["name"] = self.name
        if self.tool_calls:
            msg["tool_calls"] = [call.model_dump(include={"id", "type", "function"}) for call in self.tool_calls]
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        return msg


class FunctionDefinition(OpenAIModel):
    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None


class Tool(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIModel):
    name: StrictStr


class NamedToolChoice(OpenAIModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: MaxTokens | None = None
    logprobs: StrictBool | None = False
    top_logprobs: Count | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None


M = TypeVar("M", bound=BaseModel)


async def read_body(request: Request, model: type[M]) -> M:
    """Parse and validate a JSON body; a pydantic ValidationError becomes a 400 in the error handlers."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as e:  # bad JSON, bad UTF-8, absurd nesting
        raise APIError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the body must be a JSON object", code="invalid_json")
    return model.model_validate(data)


# ---- responses ---------------------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    # None for the first prompt token of an echo: nothing predicts it (as OpenAI and vLLM answer)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)

    def extend(self, other: "CompletionLogprobs") -> None:
        self.tokens += other.tokens
        self.token_logprobs += other.token_logprobs
        self.top_logprobs += other.top_logprobs
        self.text_offset += other.text_offset


class PromptLogprob(BaseModel):
    """vLLM's shape of one entry of `prompt_logprobs` (keyed by token id)."""

    logprob: float
    rank: int | None = None
    decoded_token: str


# One dict per prompt token (None for the first), token id -> entry: the prompt's token, then the top-n.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] = Field(default_factory=list)


class AssistantMessage(BaseModel):
    role: str = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _without_empty_tool_calls(self, handler: Any):  # unannotated: /openapi.json keeps the fields
        data = handler(self)
        if self.tool_calls is None:
            data.pop("tool_calls", None)  # a plain answer looks as it did before tools existed
        return data


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None  # vLLM puts them beside the choices: one prompt for all


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    """One piece of a streamed tool call: the first carries id, type and name, later ones arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta

    @model_serializer(mode="wrap")
    def _only_set(self, handler: Any):  # unannotated: /openapi.json keeps the fields
        data = handler(self)
        data["function"] = {k: v for k, v in data["function"].items() if v is not None}
        return {k: v for k, v in data.items() if v is not None}


class ChatDelta(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

    @model_serializer(mode="wrap")
    def _only_set(self, handler: Any):  # unannotated: /openapi.json keeps the fields
        # Unset fields are left out of a chunk: the first carries the role, later ones content or tool calls.
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "kvyard"
    max_model_len: int
    root: str | None = None  # a LoRA adapter's directory (vLLM's field)
    parent: str | None = None  # a LoRA adapter's base model
    # The model's own sampling defaults, used where a request leaves a parameter out (generation_config.json)
    generation_defaults: dict[str, float | int] = Field(default_factory=dict)
    # Whether the batch-invariant bf16 path is on: greedy outputs that depend only on the request's own tokens, never
    # on the batch, the chunking or the prefix cache (README "Batch-invariant bf16"); the base model's card only
    batch_invariant: bool | None = None


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]
