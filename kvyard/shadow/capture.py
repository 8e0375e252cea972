"""Traffic capture (#37): one JSON line per sampled request, written off the serving path.

Opt-in per deployment (`server: capture: {dir: ..., sample: 0.1}` or `--capture-dir`). A request is sampled when
it arrives; when its last choice finishes, the server hands over what it saw (token ids, sampling parameters,
timings) and goes on. A writer thread turns that into the record (text decoded there, not on the event loop)
and appends it to the current file. The queue is bounded: a full one drops the record and counts it; serving
never waits on the capture. Files rotate at `file_bytes`, and the oldest go once all of them pass `max_bytes`.

Each record carries:
- the Mooncake trace fields other replayers read: `timestamp` (ms since the capture began), `input_length`,
  `output_length`, `hash_ids` (one id per 512-token block of the prompt, chained, numbered in order of first
  sight, so shared prefixes share ids);
- OpenTelemetry GenAI names where they apply: `gen_ai.request.model`, `gen_ai.request.temperature`,
  `gen_ai.request.top_p`, `gen_ai.request.max_tokens`, `gen_ai.usage.input_tokens`,
  `gen_ai.usage.output_tokens`, `gen_ai.response.finish_reasons`;
- kvyard's own: arrival (Unix time), the sampling parameters, TTFT and inter-token times, the replica and a
  fingerprint of its configuration, and (unless `redact`) the prompt's and the output's token ids and text.
With `redact` only counts, timings, parameters and hashes are kept: no token ids, no text.
"""

import dataclasses
import hashlib
import json
import logging
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvyard.background import BoundedWorker
from kvyard.config import parse_bytes
from kvyard.errors import ConfigError

log = logging.getLogger(__name__)

HASH_BLOCK = 512  # tokens per hash id, as in Mooncake's traces
FILE_PATTERN = "capture-{:06d}.jsonl"


@dataclass
class CaptureSettings:
    dir: str  # where the JSONL files go
    sample: float = 1.0  # the share of requests captured
    redact: bool = False  # keep no token ids and no text
    file_bytes: int | str = "64MiB"  # a file is closed and the next begun past this size
    max_bytes: int | str = "1GiB"  # the oldest files are deleted once all of them pass this
    queue: int = 1024  # records waiting for the writer; more are dropped (and counted)

    def __post_init__(self) -> None:
        self.file_bytes = parse_bytes(self.file_bytes)
        self.max_bytes = parse_bytes(self.max_bytes)
        for name, ok in (("sample", 0.0 <= self.sample <= 1.0), ("queue", self.queue >= 1),
                         ("file_bytes", self.file_bytes >= 1024), ("max_bytes", self.max_bytes >= self.file_bytes)):
            if not ok:
                raise ConfigError(f"capture setting {name} is out of range: {getattr(self, name)!r}", param=name)


@dataclass
class Observed:
    """What the server saw of one choice: handed to the writer thread as is."""

    arrival_unix: float
    prompt_token_ids: list[int]
    params: Any  # SamplingParams
    output_token_ids: list[int]
    output_text: str  # as the client got it
    finish_reason: str | None
    token_times: list[float]  # time.monotonic() of each output's arrival, with its count of new tokens
    token_counts: list[int]
    arrival: float  # time.monotonic() when the HTTP request came


@dataclass
class TraceCapture:
    settings: CaptureSettings
    model: str
    replica: str
    config_fingerprint: str
    decode: Any  # prompt token ids -> text (the tokenizer's, special tokens kept), called on the writer thread
    records: int = 0
    dropped: int = 0
    _started: float = field(default_factory=time.time)
    _block_ids: dict[bytes, int] = field(default_factory=dict)
    _random: random.Random = field(default_factory=random.Random)

    def __post_init__(self) -> None:
        self.dir = Path(self.settings.dir)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"capture dir {self.dir}: {e.strerror}", param="capture") from e
        existing = sorted(self.dir.glob("capture-*.jsonl"))
        self._number = int(existing[-1].stem.split("-")[1]) + 1 if existing else 1
        self._file_bytes = 0  # in the current file, capture-{_number}
        self._trim()  # an earlier run's files count against the budget too
        self._worker: BoundedWorker[Observed] = BoundedWorker(self._write, "kvyard-capture", self.settings.queue,
                                                              self._failed)

    def sampled(self) -> bool:
        s = self.settings.sample
        return s >= 1.0 or (s > 0.0 and self._random.random() < s)

    def submit(self, seen: Observed) -> None:
        """Hand a finished choice over; never blocks (a full queue drops it, counted)."""
        if not self._worker.submit(seen):
            self.dropped += 1

    def flush(self) -> None:
        self._worker.flush()

    def close(self) -> None:
        self._worker.close()

    # ---- the writer thread -------------------------------------------------------------------------

    def _write(self, seen: Observed) -> None:
        self._append(json.dumps(self.record(seen), separators=(",", ":")) + "\n")
        self.records += 1

    def _failed(self, e: Exception) -> None:  # a full disk: the record is lost, serving goes on
        self.dropped += 1
        log.warning("capture: a record was not written (%s)", e)

    def record(self, seen: Observed) -> dict[str, Any]:
        params = seen.params
        ttft = seen.token_times[0] - seen.arrival if seen.token_times else None
        itl = [round((b - a) / n, 6) for a, b, n in zip(seen.token_times, seen.token_times[1:], seen.token_counts[1:],
                                                         strict=False) for _ in range(n)]
        out: dict[str, Any] = {
            "timestamp": int((seen.arrival_unix - self._started) * 1000),
            "input_length": len(seen.prompt_token_ids),
            "output_length": len(seen.output_token_ids),
            "hash_ids": self._hash_ids(seen.prompt_token_ids),
            "arrival_unix": round(seen.arrival_unix, 6),
            "replica": self.replica,
            "config_fingerprint": self.config_fingerprint,
            "gen_ai.request.model": self.model,
            "gen_ai.request.temperature": params.temperature,
            "gen_ai.request.top_p": params.top_p,
            "gen_ai.request.max_tokens": params.max_tokens,
            "gen_ai.usage.input_tokens": len(seen.prompt_token_ids),
            "gen_ai.usage.output_tokens": len(seen.output_token_ids),
            "gen_ai.response.finish_reasons": [seen.finish_reason],
            "params": _plain_params(params),
            "ttft_s": None if ttft is None else round(ttft, 6),
            "itl_s": itl,
        }
        if not self.settings.redact:
            out["prompt_token_ids"] = seen.prompt_token_ids
            out["prompt"] = self.decode(seen.prompt_token_ids)
            out["output_token_ids"] = seen.output_token_ids
            out["output"] = seen.output_text
        return out

    def _hash_ids(self, tokens: list[int]) -> list[int]:
        ids, chain = [], b""
        for start in range(0, len(tokens), HASH_BLOCK):
            block = ",".join(map(str, tokens[start : start + HASH_BLOCK])).encode()
            chain = hashlib.blake2b(chain + block, digest_size=16).digest()
            ids.append(self._block_ids.setdefault(chain, len(self._block_ids)))
        return ids

    def _append(self, line: str) -> None:
        data = line.encode()
        if self._file_bytes and self._file_bytes + len(data) > self.settings.file_bytes:  # type: ignore[operator]
            self._number += 1  # the next file; the directory is looked at only now, once a file is full
            self._file_bytes = 0
            self._trim()
        with (self.dir / FILE_PATTERN.format(self._number)).open("ab") as f:
            f.write(data)
        self._file_bytes += len(data)

    def _trim(self) -> None:
        """Delete the oldest full files until they and a whole new one fit the budget."""
        files = sorted(self.dir.glob("capture-*.jsonl"))
        total = sum(f.stat().st_size for f in files)
        while files and total + self.settings.file_bytes > self.settings.max_bytes:  # type: ignore[operator]
            oldest = files.pop(0)
            total -= oldest.stat().st_size
            oldest.unlink()


def _plain_params(params: Any) -> dict[str, Any]:
    """The sampling parameters a replay needs, as JSON (the compiled grammar and other runtime state left out)."""
    keep = ("n", "temperature", "top_p", "top_k", "min_p", "max_tokens", "min_tokens", "seed", "stop",
            "stop_token_ids", "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs")
    values = {k: getattr(params, k) for k in keep if hasattr(params, k)}
    return {k: list(v) if isinstance(v, tuple) else v for k, v in values.items() if _json_able(v)}


def _json_able(value: Any) -> bool:
    return value is None or isinstance(value, str | int | float | bool | list | tuple)


def config_fingerprint(config: Any) -> str:
    """A short hash of a deployment's engine configuration: records from one configuration share it."""
    text = json.dumps(dataclasses.asdict(config), sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
