"""Training examples for `kvyard lora train`: a prompt and the completion to learn, as token ids.

Three kinds of JSON line are read, and may be mixed in one file:
- a capture record (kvyard/shadow/capture.py): the rendered prompt and the output the server sent. A record
  that finished with "stop" ends with the end-of-sequence token, so that the adapter learns where to stop.
  Redacted records hold no text and are refused;
- a chat, `{"messages": [...]}` whose last message is the assistant's: the completion is that turn, as the
  chat template renders it (with its end-of-turn tokens);
- `{"prompt": ..., "completion": ...}`: the prompt is sent as one user turn through the chat template (or as is,
  with `"raw": true`), as `kvyard bench` and the speculator read prompt files.

`drop` removes fixed texts from every prompt before it is tokenized: a system prompt or an instruction that
the traffic carried and the adapter should no longer need (its behaviour folded into the weights).
"""

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvyard.errors import InvalidRequestError
from kvyard.shadow.compare import is_json

Keep = Callable[[str], bool]
KEEP: dict[str, Keep] = {"all": lambda text: True, "json": is_json}  # --keep: which completions are chosen


@dataclass
class Example:
    prompt_ids: list[int]
    completion_ids: list[int]
    completion: str  # the completion's text: what --keep judges, and what a teacher's answer replaces


def read_examples(path: str | Path, tokenizer: Any, drop: tuple[str, ...] = ()) -> list[Example]:
    """One example per non-blank line of `path`, in order; a line that is none of the three kinds is an error."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise InvalidRequestError(f"{p}: no such training file", param="data")
    examples = []
    for number, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{p}:{number}"
        try:
            record = json.loads(line)
        except ValueError as e:
            raise InvalidRequestError(f"{where}: not JSON: {e}", param="data") from e
        if not isinstance(record, dict):
            raise InvalidRequestError(f"{where}: expected a JSON object", param="data")
        examples.append(_example(record, tokenizer, drop, where))
    if not examples:
        raise InvalidRequestError(f"{p}: no training examples", param="data")
    return examples


def _example(record: dict[str, Any], tokenizer: Any, drop: tuple[str, ...], where: str) -> Example:
    if "hash_ids" in record:  # a capture record
        if "prompt" not in record or "output" not in record:
            raise InvalidRequestError(f"{where}: a redacted capture record has no text to train on", param="data")
        prompt = tokenizer(_dropped(record["prompt"], drop), add_special_tokens=False).input_ids
        completion = tokenizer(record["output"], add_special_tokens=False).input_ids
        if record.get("gen_ai.response.finish_reasons") == ["stop"] and tokenizer.eos_token_id is not None:
            completion.append(tokenizer.eos_token_id)
        return Example(prompt, completion, record["output"])
    if "messages" in record:
        return _chat(record["messages"], tokenizer, drop, where)
    if isinstance(record.get("prompt"), str) and isinstance(record.get("completion"), str):
        if record.get("raw") or tokenizer.chat_template is None:
            prompt = tokenizer(_dropped(record["prompt"], drop), add_special_tokens=True).input_ids
            completion = tokenizer(record["completion"], add_special_tokens=False).input_ids
            return Example(prompt, completion + [tokenizer.eos_token_id], record["completion"])
        chat = [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["completion"]}]
        return _chat(chat, tokenizer, drop, where)
    raise InvalidRequestError(f"{where}: expected a capture record, {{'messages'}} or {{'prompt', 'completion'}}",
                              param="data")


def _chat(messages: Any, tokenizer: Any, drop: tuple[str, ...], where: str) -> Example:
    if not (isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages)
            and messages[-1].get("role") == "assistant" and isinstance(messages[-1].get("content"), str)):
        raise InvalidRequestError(f"{where}: 'messages' must end with the assistant's turn (its text)", param="data")
    if tokenizer.chat_template is None:
        raise InvalidRequestError(f"{where}: the model has no chat template to render 'messages'", param="data")
    turns = [{**m, "content": _dropped(m["content"], drop)} if isinstance(m.get("content"), str) else m
             for m in messages]
    turns = [m for m in turns if not (m.get("role") == "system" and m.get("content") == "")]
    prompt = tokenizer.apply_chat_template(turns[:-1], add_generation_prompt=True, tokenize=True, return_dict=False)
    whole = tokenizer.apply_chat_template(turns, tokenize=True, return_dict=False)
    if whole[: len(prompt)] != prompt:
        raise InvalidRequestError(f"{where}: the chat template renders the prompt differently inside the whole "
                                  "conversation; cannot tell the completion apart", param="data")
    return Example(prompt, whole[len(prompt):], messages[-1]["content"])


def _dropped(text: str, drop: tuple[str, ...]) -> str:
    for fixed in drop:
        text = text.replace(fixed, "")
    return text


def split(examples: list[Example], held_out: float, seed: int) -> tuple[list[Example], list[Example]]:
    """Train and held-out examples, drawn at random (seeded); at least one of each when there are two."""
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    n_eval = min(len(examples) - 1, max(1 if held_out > 0 else 0, round(held_out * len(examples))))
    return [examples[i] for i in order[n_eval:]], [examples[i] for i in order[:n_eval]]

