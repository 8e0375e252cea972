"""The planner's measured timings build the engine's own layers from random weights under a checkpoint's names."""

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from kvyard.models.config import ModelConfig
from kvyard.plan.measure import dense_layer_tensors, layer_shapes, model_prefill_seconds, timeable
from kvyard.plan.measure_ranks import collective_seconds, pipe_seconds


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


def test_a_tensor_ranks_matmuls_are_its_share_of_each_layer(tiny_checkpoint):
    cfg = config_of(tiny_checkpoint("qwen2"))
    whole, half = layer_shapes(cfg), layer_shapes(cfg, tp=2)
    assert [o for o, _, _ in half][1:3] == [cfg.hidden_size, cfg.intermediate_size]  # o and gate|up split
    assert [i for _, i, _ in half] == [cfg.hidden_size, whole[1][1] // 2, cfg.hidden_size, cfg.intermediate_size // 2]
    kv = max(1, cfg.num_kv_heads // 2) * cfg.head_dim  # a KV head shared by ranks when there are fewer than them
    assert half[0][0] == cfg.num_heads // 2 * cfg.head_dim + 2 * kv


def test_ranks_collectives_and_hand_overs_are_timed_between_real_processes():
    """Bound processes in the engine's shared-memory group, and a pipe with pickled tensors, as the replica's
    ranks and stages use them: every size asked for comes back timed, and 4,096 rows cost more than one."""
    times = collective_seconds(2, (1, 4096), (1,), hidden=256, vocab=1000)
    assert set(times.all_reduce_s) == {1, 4096} and set(times.gather_s) == {1}
    assert 0 < times.all_reduce_s[1] < times.all_reduce_s[4096] < 1.0
    handed = pipe_seconds((1, 4096), 256, torch.bfloat16)
    assert 0 < handed[1] < handed[4096] < 1.0
