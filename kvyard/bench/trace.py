"""Traces to replay (`kvyard bench serve --trace FILE [--time-scale X]`): the arrival times and content of
recorded traffic.

- kvyard's capture (kvyard/shadow/capture.py: a directory of capture-*.jsonl, or one file): the real prompts,
  sent as the token ids the server saw, so what follows them (drafts accepted, where EOS falls) is the real
  traffic's; a redacted capture has no ids and gets synthetic text of its lengths, as the traces below do.
- Mooncake's JSONL traces (`timestamp` ms, `input_length`, `output_length`, `hash_ids`): lengths only. Each hash
  id becomes one block of text of 512 tokens, the same text wherever the id recurs, so shared prefixes stay
  shared.
- Azure's LLM inference CSVs (`TIMESTAMP`, `ContextTokens`, `GeneratedTokens`): lengths only.

Each request becomes a one-turn session on /v1/completions with `at_s`, its offset from the first arrival; the
replay sends it at `at_s * time_scale` after the run starts, whatever the server does (open loop).
"""

import csv
import json
import random
from datetime import datetime
from pathlib import Path
from typing import Any

from kvyard.bench.serve_workloads import Session, TextSource, Turn
from kvyard.shadow.capture import HASH_BLOCK


class TraceError(Exception):
    pass


def read_trace(path: str | Path, tokenizer: Any = None, seed: int = 0) -> list[Session]:
    """The trace's requests as sessions with their arrival offsets, in arrival order."""
    path = Path(path)
    files = sorted(path.glob("capture-*.jsonl")) if path.is_dir() else [path]
    if not files or not all(f.is_file() for f in files):
        raise TraceError(f"{path}: no trace file there")
    src = TextSource(random.Random(seed), tokenizer)
    blocks: dict[int, str] = {}
    timed: list[tuple[float, Session]] = []
    for f in files:
        rows = _csv_rows(f) if f.suffix == ".csv" else _jsonl_rows(f)
        timed += [(at, _session(row, src, blocks)) for at, row in rows]
    if not timed:
        raise TraceError(f"{path}: the trace holds no requests")
    timed.sort(key=lambda t: t[0])
    first = timed[0][0]
    for at, session in timed:
        session.at_s = at - first
    return [s for _, s in timed]


def _jsonl_rows(f: Path) -> list[tuple[float, dict[str, Any]]]:
    rows = []
    for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            rows.append((float(row["timestamp"]) / 1000.0, row))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise TraceError(f"{f}:{n}: not a trace record ({e})") from e
    return rows


def _csv_rows(f: Path) -> list[tuple[float, dict[str, Any]]]:
    rows = []
    with f.open(newline="", encoding="utf-8") as fh:
        for n, row in enumerate(csv.DictReader(fh), 2):
            try:
                at = datetime.fromisoformat(row["TIMESTAMP"].strip()[:26]).timestamp()
                rows.append((at, {"input_length": int(row["ContextTokens"]), "output_length": int(row["GeneratedTokens"])}))
            except (KeyError, ValueError) as e:
                raise TraceError(f"{f}:{n}: not an Azure trace row ({e})") from e
    return rows


def _session(row: dict[str, Any], src: TextSource, blocks: dict[int, str]) -> Session:
    length, out = int(row["input_length"]), max(1, int(row["output_length"]))
    if "prompt_token_ids" in row:  # kvyard's own capture: the real prompt
        return Session("completions", [Turn(row["prompt_token_ids"], out, length)])
    ids = row.get("hash_ids") or []
    parts = []
    for i, h in enumerate(ids):
        size = min(HASH_BLOCK, length - i * HASH_BLOCK)
        if size <= 0:
            break
        # a whole block's text is shared wherever its id recurs; a last, partial block is the prompt's own
        parts.append(blocks.setdefault(h, src.text(HASH_BLOCK)) if size == HASH_BLOCK else src.text(size))
    text = " ".join(parts) if parts else src.text(length)
    return Session("completions", [Turn(text, out, length)])
