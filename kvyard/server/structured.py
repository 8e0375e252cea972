"""Structured output on the server: which constraint a request asks for, compiled before the engine.

A request may constrain its output with OpenAI's `response_format` (`json_object`, `json_schema`) or
vLLM's extensions (`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`, or the newer
`structured_outputs` object). At most one may be set: two would contradict each other, and picking one
silently would be wrong. `json_schema` is enforced whether `strict` is true or not; kvyard never
leaves a requested format unconstrained.

The grammar is compiled here, on the compiler's own threads with a timeout, and attached to the
request's `StructuredOutput`, so the engine thread only builds a matcher. Every failure is a 400 that
names the field.
"""

import asyncio
from typing import Any

from kvyard.errors import InvalidRequestError
from kvyard.server.async_engine import AsyncEngine
from kvyard.server.protocol import SamplingFields
from kvyard.server.tokenization import FrontendTokenizer
from kvyard.structured.compiler import DEFAULT_TIMEOUT_S, GrammarCompiler
from kvyard.structured.spec import StructuredOutput


def requested_output(body: SamplingFields) -> StructuredOutput | None:
    """The one constraint in `body`, or None. InvalidRequestError (400) names a bad or extra field."""
    found = [spec for spec in _candidates(body) if spec is not None]
    if len(found) > 1:
        names = ", ".join(s.param.split(".")[0] for s in found)
        raise InvalidRequestError(f"only one output constraint may be set, got {names}", param=found[1].param)
    return found[0] if found else None


def _candidates(body: SamplingFields) -> list[StructuredOutput | None]:
    rf = body.response_format
    out: list[StructuredOutput | None] = [None if rf is None else _response_format(rf.type, rf.json_schema)]
    if body.guided_json is not None:
        out.append(StructuredOutput.json_schema(body.guided_json, param="guided_json"))
    if body.guided_regex is not None:
        out.append(StructuredOutput.regex(body.guided_regex, param="guided_regex"))
    if body.guided_choice is not None:
        out.append(StructuredOutput.choice(body.guided_choice, param="guided_choice"))
    if body.guided_grammar is not None:
        out.append(StructuredOutput.grammar(body.guided_grammar, param="guided_grammar"))
    so = body.structured_outputs
    if so is not None:
        out.extend(_structured_outputs(so.json_, so.regex, so.choice, so.grammar, so.json_object))
    return out


def _response_format(kind: str, json_schema: Any) -> StructuredOutput | None:
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput.json_object(param="response_format")
    if json_schema is None:
        raise InvalidRequestError(
            "response_format of type json_schema needs a json_schema object",
            param="response_format.json_schema",
        )
    schema = json_schema.json_schema
    if schema is None:  # OpenAI allows leaving the schema out: any JSON object then
        return StructuredOutput.json_object(param="response_format.json_schema")
    return StructuredOutput.json_schema(schema, param="response_format.json_schema.schema")


def _structured_outputs(
    json_: Any, regex: str | None, choice: list[str] | None, grammar: str | None, json_object: bool | None
) -> list[StructuredOutput]:
    p = "structured_outputs"
    out = []
    if json_ is not None:
        out.append(StructuredOutput.json_schema(json_, param=f"{p}.json"))
    if regex is not None:
        out.append(StructuredOutput.regex(regex, param=f"{p}.regex"))
    if choice is not None:
        out.append(StructuredOutput.choice(choice, param=f"{p}.choice"))
    if grammar is not None:
        out.append(StructuredOutput.grammar(grammar, param=f"{p}.grammar"))
    if json_object:
        out.append(StructuredOutput.json_object(param=f"{p}.json_object"))
    return out


class GrammarService:
    """The front end's grammar compiler, built on first use (xgrammar scans the whole vocabulary once)."""

    def __init__(
        self, engine: AsyncEngine, tokenizer: FrontendTokenizer, timeout_s: float = DEFAULT_TIMEOUT_S,
        json_whitespace: str = "compact",
    ):
        self._engine = engine
        self.json_whitespace = json_whitespace
        self._tokenizer = tokenizer
        self.timeout_s = timeout_s
        self._compiler: GrammarCompiler | None = None
        self._lock = asyncio.Lock()

    async def compiler(self) -> GrammarCompiler:
        async with self._lock:
            if self._compiler is None:
                cfg = self._engine.model_config
                eos = set(cfg.eos_token_ids)
                tok_eos = self._engine.tokenizer.eos_token_id
                if tok_eos is not None:
                    eos.add(tok_eos)  # the engine's own rule for what ends a generation
                # On the tokenizer's thread: xgrammar reads the vocabulary, and HF tokenizers are not
                # safe to use from two threads at once.
                self._compiler = await self._tokenizer.run(
                    lambda tok: GrammarCompiler(tok, cfg.vocab_size, sorted(eos), timeout_s=self.timeout_s,
                                                json_whitespace=self.json_whitespace)
                )
            self._compiler.timeout_s = self.timeout_s
            return self._compiler

    async def compile(self, spec: StructuredOutput | None) -> StructuredOutput | None:
        """`spec` with its compiled grammar attached; GrammarCompileError (400) if it does not compile."""
        if spec is None:
            return None
        return await (await self.compiler()).attach(spec)
