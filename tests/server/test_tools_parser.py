"""Reading tool calls out of text: whole, and streamed in every possible split, with the same result."""

import json

import transformers

from kvyard.server.protocol import ChatCompletionRequest
from kvyard.server.tools import ToolPlan, format_call
from kvyard.server.tools_parser import ToolCallStream, message_parts, parse_tool_calls

CALL = format_call("get_weather", {"city": "Paris", "days": [1, 2]})
TEXT = "Let me check. " + CALL + "\n" + format_call("get_time", {"tz": "CET"})


def test_parse_whole_text():
    parsed = parse_tool_calls(TEXT)
    assert parsed.content == "Let me check. \n"
    assert [(c.name, json.loads(c.arguments), c.complete) for c in parsed.calls] == [
        ("get_weather", {"city": "Paris", "days": [1, 2]}, True),
        ("get_time", {"tz": "CET"}, True),
    ]


def test_message_parts():
    content, calls = message_parts(TEXT)
    assert content == "Let me check."
    assert [c.function.name for c in calls] == ["get_weather", "get_time"]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    assert message_parts("just text") == ("just text", None)
    # A call cut short (max_tokens) is not a call, and its markup is not content either.
    assert message_parts(CALL[:-5]) == ("", None)
    second = format_call("get_time", {"tz": "CET"})
    for cut in range(1, len(second)):  # the issue's case: one whole call, then a second cut anywhere
        content, calls = message_parts("Let me check. " + CALL + "\n" + second[:cut])
        assert content == "Let me check." and [c.function.name for c in calls] == ["get_weather"], cut


def _stream(text: str, step: int) -> tuple[str, dict[int, dict]]:
    stream = ToolCallStream()
    content, calls = "", {}
    cuts = list(range(step, len(text), step)) + [len(text)]
    for n, cut in enumerate(cuts):
        delta, deltas = stream.update(text[:cut], final=n == len(cuts) - 1)
        content += delta
        for d in deltas:
            call = calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": ""})
            assert d.id is None or d.id == call["id"]
            call["arguments"] += d.function.arguments or ""
    return content, calls


def test_streaming_in_any_split_gives_the_whole_result():
    whole = parse_tool_calls(TEXT)
    for step in (1, 2, 3, 7, 50):
        content, calls = _stream(TEXT, step)
        assert content == whole.content
        assert [(c["name"], c["arguments"]) for c in calls.values()] == [
            (c.name, c.arguments) for c in whole.calls
        ]
        assert all(c["id"] for c in calls.values())


def test_a_stream_cut_anywhere_sends_only_calls_whose_arguments_parse():
    for cut in range(1, len(TEXT) + 1):
        for step in (1, 5):
            content, calls = _stream(TEXT[:cut], step)
            assert "<" not in content, (cut, content)
            for call in calls.values():
                assert isinstance(json.loads(call["arguments"]), dict), (cut, call)
            assert len(calls) == len(parse_tool_calls(TEXT[:cut]).complete_calls)


def test_streaming_never_leaks_the_call_markup_into_content():
    stream = ToolCallStream()
    sent = ""
    for cut in range(1, len(TEXT) + 1):
        delta, _ = stream.update(TEXT[:cut], final=False)
        sent += delta
        assert "<" not in sent.replace("Let me check. ", "")


def _plan(**body) -> ToolPlan:
    base = {
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    }
    return ToolPlan.from_request(ChatCompletionRequest.model_validate({**base, **body}), chat_template="x")


def test_fallback_rendering_of_a_tool_conversation():
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "f", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "sunny"},
    ]
    out = _plan().render(messages)
    assert (
        out[0]["role"] == "system"
        and '"name": "f"' in out[0]["content"]
        and "<tool_call>" in out[0]["content"]
    )
    assert out[2] == {"role": "assistant", "content": format_call("f", {"city": "Paris"})}
    assert out[3]["role"] == "user" and out[3]["content"].count("<tool_response>") == 2
    assert len(out) == 4
    assert _plan(tool_choice="none").render(messages)[0] == messages[0]  # no tools offered


# A Hermes/Qwen2.5-style template, reduced to what matters: it renders tools and calls itself.
NATIVE_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n</tool_call>'
    "{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_native_template_gets_tools_and_parsed_arguments(tiny_checkpoint):
    tok = transformers.AutoTokenizer.from_pretrained(tiny_checkpoint("llama"))
    body = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "2"},
            ],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        }
    )
    plan = ToolPlan.from_request(body, NATIVE_TEMPLATE)
    assert plan.native and plan.mode == "auto"
    messages = plan.render([m.for_template() for m in body.messages])
    text = tok.apply_chat_template(
        messages,
        tools=plan.template_tools(),
        tokenize=False,
        add_generation_prompt=True,
        chat_template=NATIVE_TEMPLATE,
    )
    assert text.startswith("<tools>f;</tools>")
    assert format_call("f", {"x": 1}) in text  # the template's own rendering matches the format kvyard parses
    assert "<|im_start|>tool\n2" in text
