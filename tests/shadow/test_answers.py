"""Reading an answer off the wire: streamed text, streamed tool calls put together, whole answers, and failures."""

import json

from kvyard.shadow.answers import AnswerReader


def _event(chunk: dict) -> bytes:
    return f"data: {json.dumps(chunk)}\n\n".encode()


def test_a_stream_gives_its_text_and_timings():
    r = AnswerReader()
    r.event(_event({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}))  # no token yet
    for piece in ("Hel", "lo", "!"):
        r.event(_event({"choices": [{"index": 0, "delta": {"content": piece}}]}))
    assert r.answer() is None  # not ended: no [DONE] yet
    r.event(b"data: [DONE]\n\n")
    a = r.answer()
    assert a.text == "Hello!" and a.ttft_s is not None and len(a.itl_s) == 2 and a.tool_calls is None


def test_streamed_tool_calls_are_put_together():
    r = AnswerReader()
    parts = [{"index": 0, "function": {"name": "get_weather", "arguments": ""}},
             {"index": 0, "function": {"arguments": '{"city": '}}, {"index": 0, "function": {"arguments": '"Oslo"}'}}]
    for p in parts:
        r.event(_event({"choices": [{"index": 0, "delta": {"tool_calls": [p]}}]}))
    r.event(b"data: [DONE]\n\n")
    assert r.answer().tool_calls == [{"name": "get_weather", "arguments": '{"city": "Oslo"}'}]


def test_whole_answers_and_failures():
    whole = AnswerReader()
    whole.whole(json.dumps({"choices": [{"index": 0, "text": "abc"}]}).encode())
    assert whole.answer().text == "abc"
    cut = AnswerReader()
    cut.event(_event({"choices": [{"index": 0, "text": "a"}]}))
    cut.event(_event({"error": {"message": "the stream was cut"}}))
    cut.event(b"data: [DONE]\n\n")
    assert cut.answer() is None and cut.failed == "the stream was cut"
    closed = []
    broken = AnswerReader(on_close=closed.append)
    broken.whole(b"not json")
    broken.close()
    broken.close()
    assert broken.answer() is None and closed == [broken]
