"""Prompt files for training and benchmarks: JSON lines, or plain text with one prompt per line.

A JSON line is `{"messages": [...]}` (a chat), or `{"prompt": "..."}`, which is sent as one user turn
through the tokenizer's chat template when it has one, or as is with `"raw": true` (completion-style
prompts such as code to continue).
"""

import json
from pathlib import Path
from typing import Any

from kvyard.errors import InvalidRequestError


def read_prompt_records(path: str | Path) -> list[dict[str, Any]]:
    p = Path(path).expanduser()
    if not p.is_file():
        raise InvalidRequestError(f"{p}: no such prompt file", param="prompts")
    lines = [line for line in p.read_text().splitlines() if line.strip()]
    if p.suffix != ".jsonl":
        return [{"prompt": line} for line in lines]
    records = []
    for i, line in enumerate(lines, 1):
        try:
            rec = json.loads(line)
        except ValueError as e:
            raise InvalidRequestError(f"{p}:{i}: not JSON: {e}", param="prompts") from e
        if not isinstance(rec, dict) or not ("prompt" in rec or "messages" in rec):
            raise InvalidRequestError(f"{p}:{i}: expected an object with 'prompt' or 'messages'", param="prompts")
        records.append(rec)
    if not records:
        raise InvalidRequestError(f"{p}: no prompts", param="prompts")
    return records


def encode_prompt(tokenizer, record: dict[str, Any]) -> list[int]:
    """Token ids of one record, as the engine would receive them."""
    messages = record.get("messages")
    if messages is None and not record.get("raw") and tokenizer.chat_template is not None:
        messages = [{"role": "user", "content": record["prompt"]}]
    if messages is None:
        return tokenizer(record["prompt"], add_special_tokens=True).input_ids
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


def read_prompts(path: str | Path, tokenizer, limit: int | None = None) -> list[list[int]]:
    records = read_prompt_records(path)
    return [encode_prompt(tokenizer, r) for r in records[:limit]]
