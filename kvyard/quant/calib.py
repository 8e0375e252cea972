"""Calibration data: the user's text or prompts, plus tool-call JSON that is always included.

Quantization error shows first where the model must be exact, and tool-call JSON is such a place, so
every calibration set carries chat-formatted tool calls, answers included (teacher-forced).
"""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvyard.errors import ConfigError

TOOL_SYSTEM = (
    'Call a function by replying with only JSON: {"name": ..., "arguments": {...}}. Functions: '
    "get_weather(city, unit: celsius|fahrenheit); search_flights(origin, destination, date, passengers: int); "
    "create_event(title, start, duration_minutes: int, attendees: list)"
)

# (user request, the call a correct assistant makes)
TOOL_CALLS: list[tuple[str, dict[str, Any]]] = [
    ("What is the weather in Paris right now?", {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}),
    ("How hot is it in Phoenix, in Fahrenheit?", {"name": "get_weather", "arguments": {"city": "Phoenix", "unit": "fahrenheit"}}),
    ("Find flights from Boston to Denver on 2025-03-14 for two people.",
     {"name": "search_flights", "arguments": {"origin": "Boston", "destination": "Denver", "date": "2025-03-14", "passengers": 2}}),
    ("I need one seat from Lisbon to Oslo on 2025-07-01.",
     {"name": "search_flights", "arguments": {"origin": "Lisbon", "destination": "Oslo", "date": "2025-07-01", "passengers": 1}}),
    ("Schedule a 30 minute standup tomorrow at 09:00 with Ana and Raj.",
     {"name": "create_event", "arguments": {"title": "Standup", "start": "09:00", "duration_minutes": 30, "attendees": ["Ana", "Raj"]}}),
    ("Book a one hour design review at 14:00 with Mia.",
     {"name": "create_event", "arguments": {"title": "Design review", "start": "14:00", "duration_minutes": 60, "attendees": ["Mia"]}}),
    ("Is it raining in Tokyo?", {"name": "get_weather", "arguments": {"city": "Tokyo", "unit": "celsius"}}),
    ("Flights for 3 from Madrid to Rome on 2025-05-20, please.",
     {"name": "search_flights", "arguments": {"origin": "Madrid", "destination": "Rome", "date": "2025-05-20", "passengers": 3}}),
]

DEFAULT_TEXT = [
    "The history of the printing press begins in the fifteenth century, when movable type made books cheaper "
    "to produce. Within a few decades presses had spread across Europe, and literacy rose with them. Scholars "
    "could compare editions, errors were corrected in later printings, and ideas travelled faster than ever.",
    "To make a simple bread, mix flour, water, salt and yeast into a dough. Knead it for ten minutes until it "
    "is smooth, let it rise for an hour in a warm place, shape it, let it rise again, and bake it in a hot "
    "oven until the crust is brown and the loaf sounds hollow when tapped.",
    "def fibonacci(n: int) -> list[int]:\n    sequence = [0, 1]\n    while len(sequence) < n:\n"
    "        sequence.append(sequence[-1] + sequence[-2])\n    return sequence[:n]\n\n"
    "print(fibonacci(10))  # [0, 1, 1, 2, 3, 5, 8, 13, 21, 34]",
    "Photosynthesis converts light energy into chemical energy. In the chloroplasts of plant cells, water is "
    "split, oxygen is released, and carbon dioxide is fixed into sugars that the plant uses to grow.",
    "Q: A train leaves at 3 pm and travels 180 km at 60 km per hour. When does it arrive?\n"
    "A: The trip takes 180 / 60 = 3 hours, so it arrives at 6 pm.",
    "User reviews are mixed: some praise the battery life and the bright screen, while others report that "
    "the charger gets warm and that the speaker is quiet at full volume.",
]


TOOL_CALL_OPENING = '{"name": "'


@dataclass
class Calibration:
    sequences: list[list[int]]  # teacher-forced token sequences for KL
    # Chat prompts that end with the opening of the call (TOOL_CALL_OPENING), so that even a small model
    # is writing a tool call and the check measures whether it stays valid JSON.
    tool_prompts: list[str]
    tool_answers: list[dict[str, Any]]


def read_calib_file(path: str | Path) -> list[str]:
    """Plain text (paragraphs split on blank lines) or JSONL with `text` or `prompt` per line."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: calibration file not found", param="calib")
    raw = p.read_text(encoding="utf-8")
    if p.suffix == ".jsonl":
        items = []
        for i, line in enumerate(raw.splitlines(), 1):
            if line.strip():
                try:
                    obj = json.loads(line)
                    items.append(str(obj.get("text") or obj["prompt"]))
                except (json.JSONDecodeError, KeyError, AttributeError) as e:
                    raise ConfigError(f"{p}:{i}: expected a JSON object with `text` or `prompt` ({e})",
                                      param="calib") from e
        return items
    return [para.strip() for para in raw.split("\n\n") if para.strip()]


def build_calibration(tokenizer: Any, texts: list[str], max_len: int = 256) -> Calibration:
    def chat(messages: list[dict[str, str]], generation_prompt: bool) -> str:
        if tokenizer.chat_template is None:
            body = "\n".join(f"{m['role']}: {m['content']}" for m in messages)
            return body + ("\nassistant:" if generation_prompt else "")
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    sequences = [tokenizer(t, add_special_tokens=True).input_ids[:max_len] for t in texts]
    prompts, answers = [], []
    for user, call in TOOL_CALLS:
        msgs = [{"role": "system", "content": TOOL_SYSTEM}, {"role": "user", "content": user}]
        answered = msgs + [{"role": "assistant", "content": json.dumps(call)}]
        sequences.append(tokenizer(chat(answered, False), add_special_tokens=False).input_ids[:max_len])
        prompts.append(chat(msgs, True) + TOOL_CALL_OPENING)
        answers.append(call)
    return Calibration([s for s in sequences if len(s) >= 2], prompts, answers)


def first_json_object(text: str) -> dict[str, Any] | None:
    """The first complete JSON object in `text`, or None."""
    start = text.find("{")
    decoder = json.JSONDecoder()
    while start != -1:
        try:
            obj, _ = decoder.raw_decode(text[start:])
            return obj if isinstance(obj, dict) else None
        except json.JSONDecodeError:
            start = text.find("{", start + 1)
    return None


def valid_tool_call(text: str) -> bool:
    """`text` (a completion of a tool prompt, opening included) holds a well-formed call first."""
    obj = first_json_object(text)
    return obj is not None and isinstance(obj.get("name"), str) and isinstance(obj.get("arguments"), dict)
