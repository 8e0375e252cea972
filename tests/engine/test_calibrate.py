from kvyard import LLM
from kvyard.config import EngineConfig
from kvyard.engine.calibrate import DECODE_CONTEXT, calibration_batches
from kvyard.engine.llm_engine import LLMEngine


def test_a_server_engine_starts_with_a_fit_and_an_untouched_cache(tiny_checkpoint):
    engine = LLMEngine(EngineConfig(model=str(tiny_checkpoint("llama")), dtype="float32"))
    cost = engine.scheduler.cost
    # Each batch timed once after an untimed round; the tiny model's 512-token context leaves out the chunk at 512.
    assert cost.ready and cost.samples == len(calibration_batches(512, 64)) - (engine.max_model_len < 640)
    fixed, per_token, per_kilo_pair = cost.coefficients
    assert fixed >= 0 and per_token > 0 and per_kilo_pair >= 0
    # Scratch requests only: no block cached or held, no counter moved, no event queued.
    blocks = engine.blocks
    assert blocks.num_free_blocks == blocks.num_blocks and blocks.num_cached_blocks == 0
    assert blocks.queried_tokens == 0 and not blocks.events and engine.stats["steps"] == 0


def test_offline_and_turned_off_engines_skip_it(tiny_checkpoint):
    path = str(tiny_checkpoint("llama"))
    assert LLM(path, dtype="float32").engine.scheduler.cost.samples == 0
    assert LLMEngine(EngineConfig(model=path, dtype="float32", max_itl_ms=0)).scheduler.cost.samples == 0


def test_small_pools_calibrate_with_what_fits(tiny_checkpoint):
    # 40 blocks of 16 tokens: the full-budget prompt (32 blocks) fits, 64 decodes at 129 tokens (576) do not.
    cfg = EngineConfig(model=str(tiny_checkpoint("llama")), dtype="float32", kv_cache_memory=40 * 16 * 2 * 2 * 2 * 16 * 4)
    engine = LLMEngine(cfg)
    assert engine.blocks.num_blocks == 40
    assert 0 < engine.scheduler.cost.samples < len(calibration_batches(512, 64))
    assert engine.blocks.num_free_blocks == 40


def test_batches_span_prompts_chunks_and_decodes():
    batches = calibration_batches(512, 64)
    assert [(0, 512)] in batches and [(512, 128)] in batches
    assert [(DECODE_CONTEXT, 1)] * 64 in batches and [(DECODE_CONTEXT, 1)] * 16 in batches
