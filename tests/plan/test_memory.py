"""The planner's memory figures against what the engine really allocates, for tiny models of several layouts."""

import pytest
import torch

from kvyard.bench.plan import held_weight_bytes
from kvyard.config import EngineConfig
from kvyard.errors import ConfigError
from kvyard.llm import LLM
from kvyard.plan.hardware import this_machine
from kvyard.plan.layouts import layout
from kvyard.plan.memory import WEIGHT_FORMATS, breakdown, kv_bytes, weight_format

LAYOUTS = {"llama": {}, "llama-tied": {"tie_word_embeddings": True}, "qwen2": {}, "qwen3": {}, "gemma3_text": {},
           "qwen2_moe": {}}


@pytest.mark.parametrize("name", LAYOUTS)
def test_weights_and_kv_are_what_the_engine_allocates(tiny_checkpoint, name):
    arch = name.removesuffix("-tied")
    llm = LLM(config=EngineConfig(model=str(tiny_checkpoint(arch, **LAYOUTS[name])), dtype="float32",
                                  kv_cache_memory="1MiB", num_threads=1))
    cfg = llm.engine.model_config
    planned = breakdown(cfg, WEIGHT_FORMATS["float32"], context=64, concurrency=1, compute_dtype="float32")
    assert planned.weights == held_weight_bytes(llm)
    # The weights share a huge-page-aligned arena (kvyard/models/huge_pages.py): a few MiB at most on top.
    caches = llm.engine.runner.kv_caches
    held = sum(c.nbytes for c in caches)
    tokens = max(c.k.shape[0] for c in caches) if cfg.layer_windows else caches[0].k.shape[0]
    if not cfg.layer_windows:
        assert planned.kv_per_token * tokens == held


def test_formats_count_their_scales():
    assert WEIGHT_FORMATS["nvfp4"].bytes(1600) == 800 + 100  # an FP8 scale per 16 values
    assert WEIGHT_FORMATS["int4-g128"].bytes(256) == 128 + 8  # a float32 scale per group
    with pytest.raises(ConfigError, match="unknown weight format"):
        weight_format("int3")


def test_a_sliding_layer_holds_at_most_its_window(tiny_checkpoint):
    llm = LLM(config=EngineConfig(model=str(tiny_checkpoint("gemma3_text")), dtype="float32", kv_cache_memory="1MiB",
                                  num_threads=1))
    cfg = llm.engine.model_config
    assert any(cfg.layer_windows)
    window = min(w for w in cfg.layer_windows if w)
    long = kv_bytes(cfg, 10 * window, "auto", torch.float32)
    assert long < 10 * kv_bytes(cfg, window, "auto", torch.float32)


@pytest.mark.parametrize(("name", "tp", "pp"), [("llama", 2, 1), ("llama-tied", 1, 2), ("llama", 2, 2)])
def test_a_parallel_layouts_first_rank_holds_what_the_planner_says(tiny_checkpoint, name, tp, pp):
    """tp splits every matrix (the vocabulary's rows too) but the norms; pp puts the embedding on the first
    stage and the head, a tied one too, on the last."""
    path = tiny_checkpoint(name.removesuffix("-tied"), **LAYOUTS[name])
    with LLM(str(path), dtype="float32", tensor_parallel_size=tp, pipeline_parallel_size=pp) as llm:
        cfg = llm.engine.model_config
        planned = breakdown(cfg, WEIGHT_FORMATS["float32"], context=64, concurrency=1, compute_dtype="float32")
        stages = layout(cfg, planned, this_machine(), tp, pp, 0.9).stage_weights
        assert len(stages) == pp and stages[0] == held_weight_bytes(llm)
