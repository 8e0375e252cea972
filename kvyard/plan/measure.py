"""This machine's rates, measured rather than assumed, for `kvyard plan --hardware this` (#38).

- memory bandwidth: the best of a few reductions over a buffer far larger than the caches;
- bf16 FLOPs: the best of a few matmuls the size of a batched prefill (2,048 rows), the weight packed as the
  engine packs it and run by the engine's own linear kernel;
- the weight streaming rate at 1 to 128 rows: bytes of weights a second the engine's linear gets through,
  over weights far larger than the caches, which is what a decode step's matmuls do;
- a model's own matmuls (`model_matmul_timings`): each dense layer's fused qkv, o, gate|up and down and the
  LM head, at the rows a step carries, the weights packed as the engine packs them and enough layers that no
  pass finds them in the caches. Small GEMMs run well below the 2,048-row peak and stream below the 2,048-wide
  rate, so a model's shapes, not a square's, are what its steps take (the operator profiles Vidur composes);
- a model's prefill (`model_prefill_seconds`): the engine's own decoder layers, random weights, run over one
  step of whole prompts and scaled to the model's layers, plus the head. A prefill layer spends a good part of
  its time outside the matmuls (attention grows with the prompt squared; norms, rotary and KV writes with its
  rows), which a decode step's fit does not carry over to.
Each figure is the best of its repeats: a VM's stalls slow single runs, never speed them up.
"""

import time
from dataclasses import replace
from typing import Any

import torch

from kvyard.models.attention import AttentionMetadata, PrefillSpan
from kvyard.models.build import build_model
from kvyard.models.config import ModelConfig
from kvyard.models.decoder import rms_norm
from kvyard.models.kv_layer import LayerKV
from kvyard.models.linear import linear, pack_weight
from kvyard.plan.hardware import Device, this_machine

BUFFER_BYTES = 512 * 2**20
REPEATS = 5
STREAM_ROWS = (1, 8, 32, 128)  # the decode batch sizes the weight streaming rate is measured at
STEP_ROWS = 512  # the rows a serving step carries at most: the weights packed as a server packs them


def best_seconds(fn, repeats: int = REPEATS) -> float:  # type: ignore[no-untyped-def]
    fn()  # warm: pages touched, kernels chosen
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def memory_bandwidth(buffer_bytes: int = BUFFER_BYTES) -> float:
    """Bytes/s read by a sum over a float32 buffer of `buffer_bytes`."""
    x = torch.ones(buffer_bytes // 4, dtype=torch.float32)
    return buffer_bytes / best_seconds(lambda: x.sum())


def matmul_flops(m: int = 2048, k: int = 2048, n: int = 2048) -> float:
    """bf16 FLOPs/s of the engine's own linear kernel, its weight packed as the engine packs it for m rows."""
    w = pack_weight(torch.randn(n, k).to(torch.bfloat16), max_rows=m)
    x = torch.randn(m, k).to(torch.bfloat16)
    return 2 * m * k * n / best_seconds(lambda: linear(x, w))


def weight_stream_rate(rows: int, total_bytes: int = BUFFER_BYTES // 2, side: int = 2048) -> float:
    """Bytes of bf16 weights a second the engine's linear kernel gets through at `rows` rows, over weights far
    larger than the caches, as a decode step's matmuls stream them (reading and computing together)."""
    count = max(1, total_bytes // (side * side * 2))
    weights = [pack_weight(torch.randn(side, side).to(torch.bfloat16), max_rows=STEP_ROWS) for _ in range(count)]
    x = torch.randn(rows, side).to(torch.bfloat16)

    def run() -> None:
        for w in weights:
            linear(x, w)
    return count * side * side * 2 / best_seconds(run, repeats=3)


def measured_this_machine(rows: tuple[int, ...] = STREAM_ROWS) -> Device:
    dev = this_machine()
    return replace(dev, bandwidth=memory_bandwidth(), flops={"bfloat16": matmul_flops()},
                   stream={r: weight_stream_rate(r) for r in rows}, note=dev.note + ", measured")


def _calls_seconds(calls: list[tuple[torch.Tensor, Any]]) -> float:
    def run() -> None:
        for x, w in calls:
            linear(x, w)
    return best_seconds(run, repeats=3)


def layer_shapes(cfg: ModelConfig, tp: int = 1) -> list[tuple[int, int, bool]]:
    """(out, in, fused gate|up) of one dense decoder layer's matmuls as the engine runs them on one of `tp`
    tensor-parallel ranks (kvyard/parallel/tensor.py: heads and the intermediate size split, a KV head shared by
    ranks when there are fewer than them)."""
    h, q, kv = cfg.hidden_size, cfg.num_heads // tp * cfg.head_dim, max(1, cfg.num_kv_heads // tp) * cfg.head_dim
    inter = cfg.intermediate_size // tp
    return [(q + 2 * kv, h, False), (h, q, False), (2 * inter, h, True), (h, inter, False)]


def model_matmul_timings(cfg: ModelConfig, rows: tuple[int, ...], total_bytes: int = BUFFER_BYTES // 2, tp: int = 1
                         ) -> dict[int, float]:
    """rows -> seconds of one decode step's matmuls at that many rows: every layer's (timed over enough packed
    copies of a layer to overrun the caches, at most the model's own layers) and the head's; on one of `tp`
    tensor-parallel ranks, its share of each (the head's vocabulary rows included)."""
    shapes = layer_shapes(cfg, tp)
    layer_bytes = sum(o * i * 2 for o, i, _ in shapes)
    copies = max(1, min(cfg.num_layers, total_bytes // layer_bytes))
    layers = [[pack_weight(torch.randn(o, i).to(torch.bfloat16), max_rows=STEP_ROWS, gate_up=g) for o, i, g in shapes]
              for _ in range(copies)]
    heads = head_timings(cfg, rows, tp)
    out = {}
    for r in rows:
        xs = {i: torch.randn(r, i).to(torch.bfloat16) for _, i, _ in shapes}
        layer_calls = [(xs[i], w) for layer in layers for w, (_, i, _) in zip(layer, shapes, strict=True)]
        out[r] = _calls_seconds(layer_calls) / copies * cfg.num_layers + heads[r]
    return out


def head_timings(cfg: ModelConfig, rows: tuple[int, ...], tp: int = 1) -> dict[int, float]:
    """rows -> seconds of the LM head's matmul (a tensor rank's share of the vocabulary) at that many rows."""
    head = pack_weight(torch.randn(-(-cfg.vocab_size // tp), cfg.hidden_size).to(torch.bfloat16), max_rows=STEP_ROWS)
    return {r: _calls_seconds([(torch.randn(r, cfg.hidden_size).to(torch.bfloat16), head)]) for r in rows}


def timeable(cfg: ModelConfig) -> bool:
    """Whether the engine runs `cfg` as the dense llama-family layers these timings build (not a Mixture of
    Experts, a latent KV cache or Gemma's layers)."""
    return not (cfg.num_experts or cfg.kv_lora_rank or cfg.model_type == "gemma3_text")


def dense_layer_tensors(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Random bf16 weights under a dense llama-family checkpoint's names, for `cfg`'s layers, embedding and head."""
    h, q, kv, inter = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, \
        cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        shapes |= {a + "q_proj.weight": (q, h), a + "k_proj.weight": (kv, h), a + "v_proj.weight": (kv, h),
                   a + "o_proj.weight": (h, q), p + "mlp.gate_proj.weight": (inter, h),
                   p + "mlp.up_proj.weight": (inter, h), p + "mlp.down_proj.weight": (h, inter),
                   p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
        if cfg.attention_bias:
            shapes |= {a + "q_proj.bias": (q,), a + "k_proj.bias": (kv,), a + "v_proj.bias": (kv,)}
        if cfg.qk_norm:
            shapes |= {a + "q_norm.weight": (cfg.head_dim,), a + "k_norm.weight": (cfg.head_dim,)}
    # Small weights keep the residual stream finite over the timed repeats.
    return {name: (torch.randn(shape) * 0.02).to(torch.bfloat16) for name, shape in shapes.items()}


def model_prefill_seconds(cfg: ModelConfig, prompts: int, length: int, total_bytes: int = BUFFER_BYTES // 2) -> float:
    """Seconds of one prefill step of `prompts` prompts of `length` tokens: the engine's own dense decoder layers
    (enough random-weight copies to overrun the caches, at most the model's own layers) run over the step and
    scaled to the model's layers, plus the head over each prompt's last token."""
    rows = prompts * length
    copies = max(1, min(cfg.num_layers, total_bytes // sum(o * i * 2 for o, i, _ in layer_shapes(cfg))))
    small = replace(cfg, num_layers=copies)
    cpu = torch.device("cpu")
    model = build_model(small, torch.bfloat16, cpu, length, max_rows=rows)
    model.load(dense_layer_tensors(small).items(), "random weights")
    caches = [LayerKV.allocate(rows, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, cpu) for _ in range(copies)]
    meta = AttentionMetadata(torch.arange(rows), prefills=[PrefillSpan(i * length, (i + 1) * length, None, None)
                                                           for i in range(prompts)])
    positions = torch.arange(length).repeat(prompts)
    x = torch.randn(rows, cfg.hidden_size).to(torch.bfloat16)
    last = torch.arange(length - 1, rows, length)
    with torch.inference_mode():
        layers_s = best_seconds(lambda: model.run_layers(x.clone(), positions, meta, caches), repeats=3)
        head_s = best_seconds(lambda: model.logits(rms_norm(x[last], model.final_norm, cfg.rms_norm_eps)))
    return layers_s / copies * cfg.num_layers + head_s
