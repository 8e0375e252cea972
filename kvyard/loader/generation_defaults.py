"""The model's own sampling defaults: generation_config.json of an HF directory, or a GGUF's metadata.

Model authors ship the temperature, top_p, ... their model was tuned for. As in vLLM (its default
`--generation-config auto`), a server request that leaves a parameter out gets the model's value, and an
explicit value always wins. Only the parameters vLLM reads are taken: `do_sample` is ignored, as vLLM
ignores it (a model that wants greedy output says temperature 0), and llama.cpp's `penalty_last_n` has
no equivalent here (kvyard's repetition penalty covers the whole sequence, as HF's does).
"""

import json
import logging
from pathlib import Path
from typing import Any

from kvyard.errors import InvalidRequestError
from kvyard.sampling_params import SamplingParams

log = logging.getLogger(__name__)

# generation_config.json key -> SamplingParams field; max_new_tokens is the default max_tokens.
HF_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
# GGUF metadata key (gguf-py's Keys.General.SAMPLING_*) -> SamplingParams field.
GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
             "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
             "general.sampling.penalty_repeat": "repetition_penalty"}
_INTEGERS = ("top_k", "max_tokens")


def checked(values: dict[str, Any], source: str) -> dict[str, float | int]:
    """The values SamplingParams accepts; a bad one is dropped with a warning, so it never fails a request."""
    out: dict[str, float | int] = {}
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            log.warning("%s: ignoring %s=%r (not a number)", source, name, value)
            continue
        if name in _INTEGERS:
            if value != int(value):
                log.warning("%s: ignoring %s=%r (not an integer)", source, name, value)
                continue
            value = int(value)
        else:
            value = float(value)
        try:
            SamplingParams(**{name: value})
        except InvalidRequestError as e:
            log.warning("%s: ignoring a generation default: %s", source, e)
            continue
        out[name] = value
    return out


def from_generation_config(root: Path) -> dict[str, float | int]:
    path = root / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        log.warning("%s: unreadable, so no generation defaults (%s)", path, e)
        return {}
    if not isinstance(data, dict):
        return {}
    return checked({field: data[key] for key, field in HF_KEYS.items() if data.get(key) is not None}, str(path))


def from_gguf_metadata(meta: dict[str, Any], source: str) -> dict[str, float | int]:
    return checked({field: meta[key] for key, field in GGUF_KEYS.items() if meta.get(key) is not None}, source)
