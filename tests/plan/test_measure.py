"""The planner's measured timings build the engine's own layers from random weights under a checkpoint's names."""

import json
import math
from pathlib import Path

import pytest
from safetensors import safe_open

from kvyard.models.config import ModelConfig
from kvyard.plan.measure import dense_layer_tensors, model_prefill_seconds, timeable


def config_of(path: Path) -> ModelConfig:
    return ModelConfig.from_hf(json.loads((path / "config.json").read_text()))


@pytest.mark.parametrize("model_type, tied", [("llama", False), ("llama", True), ("qwen2", False), ("qwen3", True)])
def test_random_layer_weights_carry_the_checkpoints_names_and_shapes(tiny_checkpoint, model_type, tied):
    """Biases (qwen2), QK-norm (qwen3) and a tied head included: the engine would load a real checkpoint's set."""
    path = tiny_checkpoint(model_type, tie_word_embeddings=tied)
    with safe_open(path / "model.safetensors", "pt") as f:
        real = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    random = {name: tuple(t.shape) for name, t in dense_layer_tensors(config_of(path)).items()}
    assert random == {n: s for n, s in real.items() if not (tied and n == "lm_head.weight")}


def test_a_prefill_step_times_the_engines_layers(tiny_checkpoint):
    cfg = config_of(tiny_checkpoint("qwen3"))
    assert timeable(cfg)
    seconds = model_prefill_seconds(cfg, prompts=2, length=32)
    assert math.isfinite(seconds) and seconds > 0


def test_layers_the_timings_do_not_build_are_not_timed(tiny_checkpoint):
    assert not timeable(config_of(tiny_checkpoint("gemma3_text")))
    assert not timeable(config_of(tiny_checkpoint("qwen2_moe")))
