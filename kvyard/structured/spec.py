"""What a constrained request asks for: one grammar, in one of a few source languages.

A `StructuredOutput` is plain data (a kind and its source text), so it travels with `SamplingParams`
and can be hashed for the compile cache. The compiled grammar may ride along in `compiled`: the
server compiles in its own thread pool and attaches the result, so the engine thread never compiles.
`compiled` takes no part in equality, hashing or repr.
"""

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Literal

from kvyard.errors import InvalidRequestError

Kind = Literal["json_object", "json_schema", "regex", "choice", "grammar", "structural_tag"]
KINDS: tuple[Kind, ...] = ("json_object", "json_schema", "regex", "choice", "grammar", "structural_tag")

# Whitespace between the tokens of constrained JSON. compact: one line with json.dumps's separators `, ` and
# `: ` and no other whitespace (`{"a": 1, "b": [2, 3]}`, the spaces are the ones models saw in training); a
# small model left free to indent tends to emit whitespace forever. any: what JSON allows, at most
# MAX_JSON_WHITESPACE characters in each gap (the behaviour before compact was the default, now bounded).
JSON_WHITESPACE = ("compact", "any")
MAX_JSON_WHITESPACE = 4

# A source this large is a mistake or an attack, not a format; it would also make compile time unbounded.
MAX_SOURCE_CHARS = 256 * 1024


@dataclass
class StructuredOutput:
    kind: Kind
    source: str = ""  # schema JSON, regex, EBNF/Lark grammar, JSON list of choices, structural tag JSON
    param: str = field(default="structured_output", compare=False)  # the request field, named in errors
    compiled: Any = field(default=None, compare=False, repr=False)  # xgrammar CompiledGrammar, if known

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequestError(f"unknown structured output kind {self.kind!r}", param=self.param)
        if not isinstance(self.source, str):
            raise InvalidRequestError("the grammar source must be a string", param=self.param)
        if len(self.source) > MAX_SOURCE_CHARS:
            raise InvalidRequestError(
                f"the grammar is longer than {MAX_SOURCE_CHARS} characters", param=self.param
            )
        if self.kind in ("regex", "grammar") and not self.source.strip():
            raise InvalidRequestError(f"the {self.kind} is empty", param=self.param)

    # ---- constructors, one per source language ---------------------------------------------------------

    @classmethod
    def json_object(cls, param: str = "response_format") -> "StructuredOutput":
        return cls("json_object", "", param)

    @classmethod
    def json_schema(
        cls, schema: dict[str, Any] | bool | str, param: str = "response_format"
    ) -> "StructuredOutput":
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise InvalidRequestError(f"the JSON schema is not valid JSON: {e}", param=param) from None
        if not isinstance(schema, dict | bool):
            raise InvalidRequestError("a JSON schema must be an object or a boolean", param=param)
        return cls("json_schema", _canonical(schema, param), param)

    @classmethod
    def regex(cls, pattern: str, param: str = "regex") -> "StructuredOutput":
        return cls("regex", pattern, param)

    @classmethod
    def choice(cls, choices: list[str], param: str = "choice") -> "StructuredOutput":
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise InvalidRequestError("choice must be a non-empty list of non-empty strings", param=param)
        return cls("choice", json.dumps(list(choices), ensure_ascii=False), param)

    @classmethod
    def grammar(cls, text: str, param: str = "grammar") -> "StructuredOutput":
        """An EBNF grammar in xgrammar's (GBNF-like) syntax with a `root` rule, or a Lark grammar."""
        return cls("grammar", text, param)

    @classmethod
    def structural_tag(cls, tag: dict[str, Any], param: str = "structural_tag") -> "StructuredOutput":
        """xgrammar's structural tag (`{"type": "structural_tag", "format": ...}`); tool calls use it."""
        return cls("structural_tag", _canonical(tag, param), param)

    # ---- derived ------------------------------------------------------------------------------------------

    @property
    def key(self) -> str:
        """Cache key: the same kind and source always compile to the same grammar."""
        return hashlib.sha256(f"{self.kind}\0{self.source}".encode()).hexdigest()

    @property
    def choices(self) -> list[str]:
        return json.loads(self.source) if self.kind == "choice" else []

    @property
    def is_lark(self) -> bool:
        # xgrammar's EBNF defines rules with `::=`; Lark uses `name: ...`. Both are accepted as "grammar".
        return self.kind == "grammar" and "::=" not in self.source


def _canonical(value: Any, param: str) -> str:
    """Compact JSON. Keys keep their order: a schema's property order is the order fields are generated."""
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as e:
        raise InvalidRequestError(f"the schema cannot be written as JSON: {e}", param=param) from None
