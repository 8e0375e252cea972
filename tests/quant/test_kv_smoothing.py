"""Key smoothing for the int8 KV cache: exact with a dense cache, and a planted large key channel no longer
coarsens the int8 cache."""

import torch

from kvyard.config import EngineConfig
from kvyard.llm import LLM
from kvyard.loader.checkpoint import load_checkpoint
from kvyard.models.decoder import DecoderModel
from kvyard.quant.fidelity import FidelityMeter, batch_logits
from kvyard.quant.kv_smoothing import qk_scales, smooth_keys

SEQS = [[5, 17, 42, 8, 99, 3, 250, 7, 61, 12, 30, 44, 2, 19], [1, 2, 3, 4, 5, 6, 7, 8, 9], [300, 20, 10, 77, 140, 9]]


def test_factors_are_powers_of_two_shared_by_each_rotary_pair_and_cancel_in_q_dot_k():
    peaks = torch.tensor([[1.0, 8.0, 0.3, 1.0], [2.0, 2.0, 2.0, 2.1]])  # [kv_heads, head_dim / 2]
    s = qk_scales(peaks, num_heads=4)  # two query heads per KV head
    assert s.shape == (4 + 2, 8)
    assert torch.equal(s, torch.exp2(torch.log2(s).round()))
    q, k = s[:4], s[4:]
    assert torch.equal(q[:, :4], q[:, 4:]) and torch.equal(k[:, :4], k[:, 4:])
    assert torch.equal(q[0], q[1]) and torch.equal(q[2], q[3])
    assert torch.equal(q[0] * k[0], torch.ones(8)) and torch.equal(q[3] * k[1], torch.ones(8))
    assert k[0, 1] < 1 < k[0, 2]  # the large pair shrinks, the small one grows
    assert torch.equal(k[1], torch.ones(8))  # an even head is left alone


def _with_large_key_channel(path, factor: float = 64.0) -> DecoderModel:
    """The tiny model with its first KV head's rotary pair (0, 8) made `factor` times larger in K and as many
    times smaller in the matching Q rows: the same function, with the large key channel Qwen2.5 has."""
    ckpt = load_checkpoint(path)
    cfg = ckpt.config
    tensors = dict(ckpt.tensors())
    pair = [0, cfg.head_dim // 2]
    a = "model.layers.{}.self_attn."
    for i in range(cfg.num_layers):
        tensors[a.format(i) + "k_proj.weight"][pair] *= factor
        for h in range(cfg.num_heads // cfg.num_kv_heads):  # the query heads of KV head 0
            tensors[a.format(i) + "q_proj.weight"][[h * cfg.head_dim + c for c in pair]] /= factor
    model = DecoderModel(cfg, torch.float32, torch.device("cpu"), max_positions=300)
    model.load(tensors.items(), str(path))
    return model


def test_smoothing_is_exact_with_a_dense_cache_and_helps_the_int8_cache(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    model = _with_large_key_channel(path)
    meter = FidelityMeter(model, SEQS)
    with torch.inference_mode():
        dense_before = batch_logits(model, SEQS)
        int8_before = meter.measure(model, kv_int8=True)
        smooth_keys(model, load_checkpoint(path).tokenizer)
        dense_after = batch_logits(model, SEQS)
        int8_after = meter.measure(model, kv_int8=True)
    assert all(layer.qk_scale is not None for layer in model.layers)
    assert all(torch.equal(a, b) for a, b in zip(dense_before, dense_after, strict=True))
    assert int8_before.kl_mean > 0
    assert int8_after.kl_mean < 0.5 * int8_before.kl_mean


def test_an_engine_smooths_keys_only_for_an_int8_cache(tiny_checkpoint):
    path = tiny_checkpoint("qwen2")
    dense = LLM(config=EngineConfig(model=str(path), kv_cache_memory="8MiB"))
    int8 = LLM(config=EngineConfig(model=str(path), kv_cache_memory="8MiB", kv_cache_dtype="int8"))
    assert all(layer.qk_scale is None for layer in dense.engine.runner.model.layers)
    runner = int8.engine.runner
    assert all(layer.qk_scale is not None for layer in runner.model.layers)
    # the caches name the factors their K is stored under, which disaggregated workers compare
    assert all(c.key_smoothing is layer.qk_scale for c, layer in zip(runner.kv_caches, runner.model.layers, strict=True))
    out = int8.generate([SEQS[0]], None)[0]
    assert len(out.outputs[0].token_ids) > 0
