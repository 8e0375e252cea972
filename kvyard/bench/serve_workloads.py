"""Workloads of `kvyard bench serve`, as text, so that any OpenAI-compatible server can take them.

A workload is a list of sessions; a session is one or more turns sent one after the other (only
`multi-turn` has more than one). Prompts are text rather than token ids because servers disagree on
token-id prompts (llama.cpp's chat endpoint has none); with `--tokenizer` the text is made of the
target model's own tokens, so its length in tokens is close to the one asked for.
"""

import random
from dataclasses import dataclass
from typing import Any, Literal

WORKLOADS = ("random", "shared-prefix", "multi-turn", "tool-call", "chat-tools")

# Short, common words: most BPE vocabularies have each as one token (with its leading space), so
# N words are about N tokens when no tokenizer is given.
_WORDS = (
    "the of and to in is for on that with as it at by from this be are was an or have not but can "
    "all one new more time will when out up if about so what which their there other has two make "
    "like into than then some could them way use any each first see over only very after work well "
    "also back good most just year long much day may such here old water take find people small "
    "number part place sound great where help through line right too mean same tell boy follow came "
    "want show three give air land hand house picture again animal point mother world near build "
    "self earth father head stand own page should country found answer school grow study still learn "
    "plant cover food sun four between state keep eye never last let thought city tree cross farm "
    "hard start might story saw far sea draw left late run while press close night real life few north"
).split()


@dataclass
class Turn:
    content: str | list[int]  # the user message (chat) or the whole prompt (completions: text or token ids)
    max_tokens: int
    prompt_tokens: int  # the intended length of `content`, in tokens (words without a tokenizer)


@dataclass
class Session:
    endpoint: Literal["completions", "chat"]
    turns: list[Turn]
    system: str | None = None
    tools: list[dict[str, Any]] | None = None
    group: int | None = None  # shared-prefix: which prefix this session uses
    at_s: float | None = None  # a replayed trace: when it arrives, seconds after the first request


@dataclass
class WorkloadSpec:
    name: str = "random"
    num_requests: int = 64
    input_len: int = 128
    output_len: int = 64
    range_ratio: float = 0.0
    num_groups: int = 4  # shared-prefix
    prefix_len: int = 512  # shared-prefix
    turns: int = 3  # multi-turn
    history_len: int = 0  # multi-turn: a context of its own (a document, an earlier chat) opens each conversation
    tool_share: float = 0.3  # chat-tools: the share of requests that offer tools and ask for a call
    seed: int = 0


class TextSource:
    """Text of about n tokens: random in-vocabulary tokens of a tokenizer, or common words."""

    def __init__(self, rng: random.Random, tokenizer: Any = None):
        self.rng = rng
        self.tokenizer = tokenizer
        if tokenizer is not None:
            special = set(tokenizer.all_special_ids)
            self.vocab = [i for i in range(len(tokenizer)) if i not in special]

    def text(self, n: int) -> str:
        if self.tokenizer is None:
            return " ".join(self.rng.choice(_WORDS) for _ in range(n))
        ids = [self.rng.choice(self.vocab) for _ in range(n)]
        # Decoding random ids and encoding the text again rarely gives back the same ids (merges
        # across token boundaries), so cut the re-encoded ids to n: the server sees about n tokens.
        text = self.tokenizer.decode(ids)
        again = self.tokenizer.encode(text, add_special_tokens=False)[:n]
        return self.tokenizer.decode(again)

    def count(self, text: str) -> int:
        if self.tokenizer is None:
            return len(text.split())
        return len(self.tokenizer.encode(text, add_special_tokens=False))


def load_tokenizer(name: str) -> Any:
    """A kvyard model name or path (HF directory, GGUF) through kvyard's loader, else an HF hub name."""
    from kvyard.errors import CheckpointError

    try:
        from kvyard.loader.checkpoint import load_checkpoint
        from kvyard.loader.registry import resolve_model

        return load_checkpoint(resolve_model(name)).tokenizer
    except CheckpointError:
        import transformers

        return transformers.AutoTokenizer.from_pretrained(name)


def _length(rng: random.Random, n: int, ratio: float) -> int:
    """Uniform in [n(1-r), n(1+r)], at least 1 (vLLM's random dataset does the same)."""
    return max(1, rng.randint(int(n * (1 - ratio)), int(n * (1 + ratio))))


TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city.",
        "parameters": {"type": "object", "required": ["city"], "properties": {
            "city": {"type": "string", "description": "City name"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}},
    {"type": "function", "function": {
        "name": "search_flights", "description": "Flights between two airports on a date.",
        "parameters": {"type": "object", "required": ["origin", "destination", "date"], "properties": {
            "origin": {"type": "string"}, "destination": {"type": "string"},
            "date": {"type": "string", "description": "YYYY-MM-DD"}}}}},
    {"type": "function", "function": {
        "name": "convert_currency", "description": "Convert an amount between currencies.",
        "parameters": {"type": "object", "required": ["amount", "from", "to"], "properties": {
            "amount": {"type": "number"}, "from": {"type": "string"}, "to": {"type": "string"}}}}},
]

_TOOL_ASKS = (
    "What is the weather in {city} right now, in celsius? Call the right function.",
    "Find me flights from {city} to Lisbon on 2026-05-14. Answer with a function call only.",
    "How much is 250 euros in US dollars? I am in {city}. Use a tool.",
)
_CITIES = ("Paris", "Tokyo", "Lima", "Oslo", "Nairobi", "Toronto", "Seoul", "Madrid")


def tool_session(rng: random.Random, i: int, spec: WorkloadSpec) -> Session:
    """A chat request that offers TOOLS and asks for one of them."""
    ask = _TOOL_ASKS[i % len(_TOOL_ASKS)].format(city=rng.choice(_CITIES))
    return Session("chat", [Turn(ask, _length(rng, spec.output_len, spec.range_ratio), len(ask.split()))], tools=TOOLS)


def build_sessions(spec: WorkloadSpec, tokenizer: Any = None) -> list[Session]:
    """The sessions of a workload; their turns add up to exactly `spec.num_requests` requests."""
    rng = random.Random(spec.seed)
    src = TextSource(rng, tokenizer)
    n = spec.num_requests

    def turn(text_len: int) -> Turn:
        return Turn(src.text(text_len), _length(rng, spec.output_len, spec.range_ratio), text_len)

    if spec.name == "random":
        return [Session("completions", [turn(_length(rng, spec.input_len, spec.range_ratio))]) for _ in range(n)]
    if spec.name == "shared-prefix":
        prefixes = [src.text(spec.prefix_len) for _ in range(spec.num_groups)]
        sessions = [
            Session("chat", [turn(_length(rng, spec.input_len, spec.range_ratio))],
                    system=prefixes[i % spec.num_groups], group=i % spec.num_groups)
            for i in range(n)
        ]
        rng.shuffle(sessions)  # groups interleave, as independent users' requests would
        return sessions
    if spec.name == "multi-turn":
        sessions = []
        for start in range(0, n, spec.turns):
            k = min(spec.turns, n - start)  # the last conversation is shorter if turns does not divide n
            history = src.text(spec.history_len) if spec.history_len else None
            sessions.append(Session("chat", [turn(_length(rng, spec.input_len, spec.range_ratio)) for _ in range(k)],
                                    system=history))
        return sessions
    if spec.name == "tool-call":
        return [tool_session(rng, i, spec) for i in range(n)]
    if spec.name == "chat-tools":  # plain chat turns, `tool_share` of them tool calls, mixed in at random
        return [tool_session(rng, i, spec) if rng.random() < spec.tool_share else
                Session("chat", [turn(_length(rng, spec.input_len, spec.range_ratio))]) for i in range(n)]
    raise ValueError(f"unknown workload {spec.name!r}; choose from {', '.join(WORKLOADS)}")
