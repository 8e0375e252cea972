"""The rate model's shape: rooflines, tensor-parallel communication, pipeline stages, queueing."""

import math
from dataclasses import replace

import pytest

from kvyard.plan.hardware import device
from kvyard.plan.layouts import layout
from kvyard.plan.memory import WEIGHT_FORMATS, breakdown
from kvyard.plan.model_spec import described
from kvyard.plan.rates import (
    SharedCores,
    fit_layer_cost,
    fit_sync,
    predict,
    queueing_wait_s,
    shared_prefill_s,
)

MODEL = described("params=8e9,layers=32,hidden=4096,heads=32,kv_heads=8,head_dim=128,vocab=128256")
H100 = device("h100")


def _rates(tp: int, pp: int, batch: int, context: int = 1024):
    mem = breakdown(MODEL.config, WEIGHT_FORMATS["bfloat16"], context, batch, size=MODEL.size)
    lo = layout(MODEL.config, mem, H100, tp, pp, 0.9)
    return mem, predict(MODEL.config, MODEL.active_params, mem, H100, lo, batch, context)


def test_batch_one_is_memory_bound_and_reads_the_weights_once_a_token():
    mem, r = _rates(1, 1, 1)
    assert r.bound == "memory"
    assert r.decode_step_s == pytest.approx((mem.weights_read + 1024 * mem.kv_per_token) / H100.bandwidth)


def test_a_large_batch_becomes_compute_bound():
    assert _rates(1, 1, 4096, context=16)[1].bound == "compute"


def test_tensor_parallelism_splits_the_reads_and_pays_for_its_all_reduces():
    one, two = _rates(1, 1, 1)[1], _rates(2, 1, 1)[1]
    assert one.decode_step_s / 2 < two.decode_step_s < one.decode_step_s  # faster, but not twice: the all-reduces


def test_pipeline_stages_add_room_not_weight_reading_speed():
    """Every micro-batch reads its stage's weights again; only the KV reads spread over the stages."""
    one, two = _rates(1, 1, 8, context=16)[1], _rates(1, 2, 8, context=16)[1]
    assert two.decode_tok_s == pytest.approx(one.decode_tok_s, rel=0.01)
    long_one, long_two = _rates(1, 1, 8, context=8192)[1], _rates(1, 2, 8, context=8192)[1]
    assert long_two.decode_tok_s > long_one.decode_tok_s


def test_queueing_grows_without_bound_near_saturation():
    assert queueing_wait_s(0.1, 0.0, 10.0) == 0.0
    assert queueing_wait_s(0.1, 5.0, 10.0) == pytest.approx(0.1)
    assert queueing_wait_s(0.1, 9.9, 10.0) > 9 and math.isinf(queueing_wait_s(0.1, 10.0, 10.0))


def test_measured_matmul_timings_replace_the_matmul_rooflines():
    """With this model's matmuls timed at its shapes, a decode step is their time at its rows (interpolated)
    plus the KV reads and attention; a measured prefill step gives prefill its rows over its seconds."""
    context, timings = 1024, {1: 0.010, 32: 0.020}
    mem = breakdown(MODEL.config, WEIGHT_FORMATS["bfloat16"], context, 16, size=MODEL.size)
    lo = layout(MODEL.config, mem, H100, 1, 1, 0.9)
    r = predict(MODEL.config, MODEL.active_params, mem, H100, lo, 16, context, matmul_s=timings,
                prefill_s={2048: 0.512})
    cfg = MODEL.config
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * context
    peak = H100.flops["bfloat16"]
    kv_s = 16 * context * lo.kv_per_token_per_device / H100.bandwidth
    expected_step = 0.010 + (0.020 - 0.010) * 15 / 31 + kv_s + 16 * attention / peak
    assert r.decode_step_s == pytest.approx(expected_step)
    assert r.prefill_tok_s == pytest.approx(2048 / 0.512)


def test_a_layer_cost_fitted_on_one_model_closes_its_gap_and_scales_with_rows_and_width():
    cfg = MODEL.config
    fixed, slope = 50e-6, 20e-12
    predicted = {1: 0.010, 32: 0.020}
    measured = {r: s + cfg.num_layers * (fixed + slope * r * cfg.hidden_size) for r, s in predicted.items()}
    cost = fit_layer_cost(cfg, predicted, measured)
    assert cost.fixed_s == pytest.approx(fixed) and cost.per_row_hidden_s == pytest.approx(slope)
    mem = breakdown(cfg, WEIGHT_FORMATS["bfloat16"], 1024, 8, size=MODEL.size)
    lo = layout(cfg, mem, H100, 1, 1, 0.9)
    plain = predict(cfg, MODEL.active_params, mem, H100, lo, 8, 1024)
    with_cost = predict(cfg, MODEL.active_params, mem, H100, lo, 8, 1024, layer_cost=cost)
    assert with_cost.decode_step_s - plain.decode_step_s == pytest.approx(cfg.num_layers * cost.at(8, cfg.hidden_size))
    assert fit_layer_cost(cfg, measured, predicted).fixed_s == 0.0  # a model faster than predicted adds nothing


def _shared_rates(tp: int, pp: int, batch: int, shared: SharedCores, context: int = 128):
    dev = replace(device("h100"), name="this", link=0.0)  # one machine's memory; its ranks share its cores
    mem = breakdown(MODEL.config, WEIGHT_FORMATS["bfloat16"], context, batch, size=MODEL.size)
    lo = layout(MODEL.config, mem, dev, tp, pp, 0.9)
    r = predict(MODEL.config, MODEL.active_params, mem, dev, lo, batch, context, prefill_s={2048: 1.0}, shared=shared)
    cfg, micro = MODEL.config, max(batch / pp, 1)
    kv_s = micro * context * lo.kv_per_token_per_device * tp * pp / dev.bandwidth
    attention_s = micro * 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * context / pp / dev.flops["bfloat16"]
    return r, kv_s + attention_s


SHARED = SharedCores(matmul_s={1: 0.040, 16: 0.044, 32: 0.048}, all_reduce_s={1: 20e-6, 32: 50e-6, 2048: 1e-3},
                     gather_s={1: 1e-4, 32: 4e-3}, hidden_pipe_s={1: 3e-4, 16: 4e-4, 2048: 5e-3},
                     logits_pipe_s={1: 5e-4, 16: 3e-3}, matmul_alone_s={1: 0.036, 16: 0.040}, head_s={1: 4e-3, 16: 3e-3},
                     tensor_sync_s=3e-3, stage_sync_s=1e-3)


def test_tensor_ranks_on_shared_cores_divide_no_time_and_pay_collectives_and_a_sync():
    """Each rank computes with its share of the cores: the step is one rank's measured matmuls, the step's
    2 L + 1 all-reduces and the logits' gather, and the fitted sync."""
    cfg = MODEL.config
    r, rest = _shared_rates(2, 1, 32, SHARED)
    collectives = (2 * cfg.num_layers + 1) * 50e-6 + 4e-3
    assert r.decode_step_s == pytest.approx(0.048 + rest + collectives + 3e-3)
    # prefill: the whole machine's step, plus its collectives at the step's rows and one sync
    assert r.prefill_tok_s == pytest.approx(2048 / (1.0 + (2 * cfg.num_layers + 1) * 1e-3 + 1e-4 + 3e-3))


def test_pipeline_stages_on_shared_cores_take_turns_or_wait_for_the_last_stage():
    """A lone sequence goes through the stages one at a time, each at its share of the alone-timed matmuls;
    with a micro-batch per stage, the last stage (it holds the head) sets the pace. Stages hand hidden states
    down and logits back, and each stage step pays the stages' sync, not the tensor ranks'."""
    one, rest = _shared_rates(1, 2, 1, SHARED)
    assert one.decode_step_s == pytest.approx(2 * (0.036 / 2 + rest + (3e-4 + 5e-4) / 2 + 1e-3))
    many, rest = _shared_rates(1, 2, 32, SHARED)
    assert many.decode_step_s == pytest.approx(2 * ((0.044 - 3e-3) / 2 + 3e-3 + rest + (4e-4 + 3e-3) / 2 + 1e-3))
    # prefill: two micro-batches through two stages take 3 half-steps, and every row's hidden states cross once
    assert one.prefill_tok_s == pytest.approx(2048 / (1.5 + 5e-3 + 2 * 1e-3))
    four = layout(MODEL.config, breakdown(MODEL.config, WEIGHT_FORMATS["bfloat16"], 128, 1, size=MODEL.size), H100,
                  1, 4, 0.9)  # four micro-batches through four stages: 7 quarter-steps, 3 boundaries crossed
    assert shared_prefill_s(MODEL.config, four, SHARED, 2048, 1.0) == pytest.approx(7 / 4 + 3 * 5e-3 + 4 * 1e-3)


def test_the_sync_fitted_on_one_layout_closes_its_mean_gap():
    assert fit_sync({1: 0.050, 32: 0.080}, {1: 0.046, 32: 0.074}, pp=1) == pytest.approx(0.005)
    assert fit_sync({1: 0.040}, {1: 0.046}, pp=1) == 0.0  # faster than predicted adds nothing
