"""OpenAI tool calling: the prompt that offers tools, the grammar that keeps calls valid.

Call format. kvyard uses the Hermes/Qwen2.5 format, one call per block:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

* Native: when the model's chat template renders tools in this format itself (Qwen2.5, Qwen3,
  Hermes: the template mentions `tools` and `<tool_call>`), the template gets the tools and the history
  as they are (assistant `arguments` parsed into objects, as HF templates expect).
* Fallback, for every other template (SmolLM2's has no tool support): kvyard writes the tool list and
  the format above into the system message, renders assistant tool calls as those blocks and tool
  results as a user message of `<tool_response>` blocks. The template then only sees plain text.

Constraint, by `tool_choice` (xgrammar structural tags; each call's arguments follow that function's
`parameters` schema, and its name is one of the offered tools):

* `none` (or no tools): tools are not offered, the output is free text;
* `auto` (default with tools): free text; once the model writes `<tool_call>`, the rest of the block
  is constrained to a valid call;
* `required`: one or more calls and nothing else (`parallel_tool_calls: false`: exactly one);
* a named function: exactly one call of that function, whatever `parallel_tool_calls` says.
"""

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from kvyard.errors import InvalidRequestError
from kvyard.server.protocol import ChatCompletionRequest
from kvyard.structured.spec import StructuredOutput

BEGIN = "<tool_call>"
END = "</tool_call>"
# What the grammar forces around the arguments object of a call (see `_call_tag`).
_HEAD = BEGIN + '\n{"name": %s, "arguments": '
_TAIL = "}\n" + END
# Whitespace allowed between JSON tokens of the arguments: enough for compact JSON, too little to loop on.
_MAX_WHITESPACE = 2

_FALLBACK_PROMPT = """You can call functions to help answer. These are the functions, as JSON schemas:
<tools>
{tools}
</tools>
To call a function, answer with a block in exactly this format, one per call:
<tool_call>
{{"name": "<function name>", "arguments": <the arguments as a JSON object>}}
</tool_call>"""

Mode = Literal["none", "auto", "required", "named"]


@dataclass
class ToolPlan:
    """How one chat request offers tools to the model and constrains its calls."""

    mode: Mode
    functions: list[dict[str, Any]] = field(default_factory=list)  # name, description, parameters
    native: bool = False  # the chat template renders tools and calls itself
    parallel: bool = True

    @classmethod
    def from_request(cls, body: ChatCompletionRequest, chat_template: str | None) -> "ToolPlan":
        native = bool(chat_template) and "tools" in chat_template and BEGIN in chat_template  # type: ignore[operator]
        functions = [t.function.model_dump(exclude_none=True) for t in body.tools or []]
        _check_names(functions)
        choice = body.tool_choice
        if choice is not None and not functions and choice != "none":
            raise InvalidRequestError("tool_choice needs tools", param="tool_choice")
        parallel = body.parallel_tool_calls is not False
        if not functions or choice == "none":
            return cls("none", [], native, parallel)
        if choice is None or isinstance(choice, str):
            return cls(choice or "auto", functions, native, parallel)  # type: ignore[arg-type]
        chosen = [f for f in functions if f["name"] == choice.function.name]
        if not chosen:
            raise InvalidRequestError(
                f"tool_choice names {choice.function.name!r}, which is not in tools", param="tool_choice"
            )
        return cls("named", chosen, native, parallel)

    @property
    def active(self) -> bool:
        return self.mode != "none"

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools argument of the chat template (native templates only)."""
        if not (self.native and self.active):
            return None
        return [{"type": "function", "function": f} for f in self.functions]

    def render(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The conversation as the chat template should see it."""
        if self.native:
            return [_native_message(m) for m in messages]
        out = _fallback_messages(messages)
        if self.active:
            out = _with_tool_prompt(out, self.functions)
        return out

    def parameter_schemas(self) -> list[tuple[str, dict[str, Any]]]:
        """(param name for errors, schema) of every offered function, to check each one on its own."""
        return [(f"tools.{i}.function.parameters", _parameters(f)) for i, f in enumerate(self.functions)]

    def constraint(self) -> StructuredOutput | None:
        """The structural tag that keeps calls valid, or None when nothing is constrained."""
        if not self.active:
            return None
        tags = [_call_tag(f) for f in self.functions]
        if self.mode == "auto":
            fmt = {
                "type": "triggered_tags",
                "triggers": [BEGIN],
                "tags": tags,
                "at_least_one": False,
                "stop_after_first": not self.parallel,
            }
        else:
            fmt = {
                "type": "tags_with_separator",
                "tags": tags,
                "separator": "\n",
                "at_least_one": True,
                "stop_after_first": self.mode == "named" or not self.parallel,
            }
        return StructuredOutput.structural_tag({"type": "structural_tag", "format": fmt}, param="tools")


def _check_names(functions: list[dict[str, Any]]) -> None:
    seen: set[str] = set()
    for i, f in enumerate(functions):
        name = f["name"]
        if not name or len(name) > 64 or not all(c.isalnum() or c in "_-." for c in name):
            raise InvalidRequestError(
                "a function name must be 1-64 letters, digits, '_', '-' or '.'",
                param=f"tools.{i}.function.name",
            )
        if name in seen:
            raise InvalidRequestError(f"two tools are named {name!r}", param=f"tools.{i}.function.name")
        seen.add(name)


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    # No parameters: any JSON object (OpenAI's reading of a function without a schema).
    return function.get("parameters") or {"type": "object"}


def _call_tag(function: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "tag",
        "begin": _HEAD % json.dumps(function["name"]),
        "content": {
            "type": "json_schema",
            "json_schema": _parameters(function),
            "max_whitespace_cnt": _MAX_WHITESPACE,
        },
        "end": _TAIL,
    }


# ---- rendering the conversation -----------------------------------------------------------------------


def _arguments_object(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments  # not JSON: shown as the client sent it


def _native_message(msg: dict[str, Any]) -> dict[str, Any]:
    if not msg.get("tool_calls"):
        return msg
    calls = [
        {**c, "function": {**c["function"], "arguments": _arguments_object(c["function"]["arguments"])}}
        for c in msg["tool_calls"]
    ]
    return {**msg, "tool_calls": calls}


def format_call(name: str, arguments: Any) -> str:
    """One call as the model writes it (the text the grammar allows)."""
    return (_HEAD % json.dumps(name)) + json.dumps(arguments, ensure_ascii=False) + _TAIL


def _fallback_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for msg in messages:
        if msg["role"] == "tool":
            block = f"<tool_response>\n{msg.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block  # consecutive results: one user turn
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
        elif msg.get("tool_calls"):
            calls = [
                format_call(c["function"]["name"], _arguments_object(c["function"]["arguments"]))
                for c in msg["tool_calls"]
            ]
            text = "\n".join(([msg["content"]] if msg.get("content") else []) + calls)
            out.append({"role": "assistant", "content": text})
        else:
            out.append(msg)
    return [{k: v for k, v in m.items() if k != "_tool_results"} for m in out]


def _with_tool_prompt(
    messages: list[dict[str, Any]], functions: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    listing = "\n".join(json.dumps(f, ensure_ascii=False) for f in functions)
    prompt = _FALLBACK_PROMPT.format(tools=listing)
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        return [{**first, "content": f"{first.get('content') or ''}\n\n{prompt}"}, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]
