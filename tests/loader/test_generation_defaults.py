"""The model's sampling defaults, from generation_config.json or GGUF metadata; bad values never get through."""

import json
import shutil

from kvyard.loader.checkpoint import load_checkpoint
from kvyard.loader.generation_defaults import checked
from tests.loader.tiny_gguf import write_tiny_gguf


def test_generation_config_json(tiny_checkpoint, tmp_path):
    path = tmp_path / "m"
    shutil.copytree(tiny_checkpoint("llama"), path)
    assert load_checkpoint(path).generation_defaults == {}  # HF's own file: token ids only
    config = json.loads((path / "generation_config.json").read_text())
    config.update(temperature=0.6, top_p=0.9, top_k=20, repetition_penalty=1.05, max_new_tokens=64,
                  do_sample=True, min_p=None)
    (path / "generation_config.json").write_text(json.dumps(config))
    assert load_checkpoint(path).generation_defaults == {
        "temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.05, "max_tokens": 64}


def test_gguf_sampling_metadata(tiny_checkpoint, tmp_path):
    meta = {"general.sampling.temp": 0.7, "general.sampling.top_k": 40, "general.sampling.top_p": 0.95,
            "general.sampling.min_p": 0.05, "general.sampling.penalty_repeat": 1.1}
    path = write_tiny_gguf(tiny_checkpoint("llama"), tmp_path / "m.gguf", metadata=meta)
    defaults = load_checkpoint(path).generation_defaults
    assert defaults.keys() == {"temperature", "top_k", "top_p", "min_p", "repetition_penalty"}
    assert defaults["top_k"] == 40 and abs(defaults["temperature"] - 0.7) < 1e-6  # stored as float32


def test_invalid_values_are_dropped(caplog):
    values = {"temperature": -1.0, "top_p": 0.0, "top_k": 2.5, "repetition_penalty": True, "max_tokens": "9",
              "min_p": 0.1}
    assert checked(values, "here") == {"min_p": 0.1}
    assert caplog.text.count("here: ignoring") == 5
