"""The C++ decode stack (kvyard/models/decode_stack.py) against the layer-by-layer path: the same kernels in the
same order, so decode steps must give bit-identical tokens and logprobs, whatever the weights and cache."""

import pytest
import torch

from kvyard.config import EngineConfig
from kvyard.kernels import cpu as cpu_kernels
from kvyard.llm import LLM
from kvyard.models.attention import AttentionMetadata, PrefillSpan
from kvyard.models.decode_stack import FUSED_MAX_ROWS, build_decode_stack, takes_step
from kvyard.models.kv_layer import LayerKV
from kvyard.quant.qlinear import make_linear
from kvyard.quant.qtensor import QuantizedTensor
from kvyard.quant.scheme import parse_weight_scheme
from kvyard.quant.tool import QuantizeOptions, quantize_model
from kvyard.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="kvyard's CPU kernels did not build here")

PROMPTS = ["hello world", "def add(a, b):", "The quick brown fox", '{"name": "get_weather"']


def _runs(path, monkeypatch, **config) -> dict[str, list]:
    """Greedy completions with logprobs, the stack on and off; also whether the stack ran the first engine."""
    results, used = {}, None
    for flag in ("1", "0"):
        monkeypatch.setenv("KVYARD_DECODE_STACK", flag)
        llm = LLM(config=EngineConfig(model=str(path), kv_cache_memory="16MiB", **config))
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0, logprobs=3, ignore_eos=True))
        results[flag] = [(o.outputs[0].token_ids, [(lp.token_id, lp.logprob, lp.top) for lp in o.outputs[0].logprobs])
                         for o in outs]
        stack = llm.engine.runner.model._stack
        if flag == "1":
            used = stack is not None and stack[1] is not None
    return {"stack": results["1"], "layers": results["0"], "used": used}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bit_identical_to_the_layer_path(tiny_checkpoint, monkeypatch, arch, dtype):
    """llama, qwen2 (q/k/v biases) and qwen3 (q/k norms), in both compute dtypes: four requests decode together,
    so the steps carry 1 to 4 rows."""
    r = _runs(tiny_checkpoint(arch), monkeypatch, dtype=dtype)
    assert r["used"]
    assert r["stack"] == r["layers"]


def test_int8_kv_cache_with_key_smoothing(tiny_checkpoint, monkeypatch):
    """An int8 cache: the stack writes and reads it through the same kernels, with the smoothing factors on q, k."""
    r = _runs(tiny_checkpoint("qwen2"), monkeypatch, dtype="bfloat16", kv_cache_dtype="int8")
    assert r["used"]
    assert r["stack"] == r["layers"]


@pytest.mark.parametrize("scheme", ["int8", "int4-g32-asym"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("outliers", [0.0, 0.05])
def test_quantized_checkpoints(tiny_checkpoint, tmp_path, monkeypatch, scheme, dtype, outliers):
    out = tmp_path / scheme
    quantize_model(QuantizeOptions(model=str(tiny_checkpoint("qwen2")), scheme=scheme, out=out, dtype="float32",
                                   progress=False, max_seq_len=64, sensitivity=False, tool_eval=False,
                                   scaling="none", outlier_columns=outliers))
    r = _runs(out, monkeypatch, dtype=dtype)
    # outlier columns ride in the low-bit kernels over VNNI blocks (AMX or AVX-512); elsewhere the stack declines them
    fused_outliers = dtype == "bfloat16" and (cpu_kernels.vnni_lowbit_available() or cpu_kernels.amx_available())
    assert r["used"] == (not outliers or fused_outliers)
    assert r["stack"] == r["layers"]


def test_rebuilt_when_a_weight_changes(tiny_checkpoint):
    """The quantizer swaps units in place, and int8 caches set qk_scale after load: the stack follows."""
    llm = LLM(config=EngineConfig(model=str(tiny_checkpoint("llama")), dtype="float32", kv_cache_memory="16MiB"))
    model = llm.engine.runner.model
    first = model._decode_stack()
    assert first is not None and model._decode_stack() is first  # kept while nothing changes
    layer = model.layers[0]
    layer.o = make_linear(QuantizedTensor.quantize(layer.o.float(), parse_weight_scheme("int8")), model.dtype,
                          model.device)
    assert model._decode_stack() is not first


def test_declines_weights_without_a_kernel(tiny_checkpoint):
    llm = LLM(config=EngineConfig(model=str(tiny_checkpoint("llama")), dtype="float32", kv_cache_memory="16MiB"))
    model = llm.engine.runner.model
    assert build_decode_stack(model) is not None
    model.layers[1].down = lambda x: x  # a callable stand-in (the quantizer's Hessian recorders are such)
    assert build_decode_stack(model) is None


def test_takes_decode_steps_only():
    cache = LayerKV.allocate(64, 2, 16, torch.bfloat16, torch.device("cpu"))
    x = torch.zeros(3, 64, dtype=torch.bfloat16)
    decode = AttentionMetadata(slot_mapping=torch.arange(3), decode_blocks=torch.zeros(3, 1, dtype=torch.long),
                               decode_lens=torch.ones(3, dtype=torch.long), num_decodes=3)
    assert takes_step(x, decode, [cache])
    mixed = AttentionMetadata(slot_mapping=torch.arange(3), decode_blocks=decode.decode_blocks,
                              decode_lens=decode.decode_lens, num_decodes=2, prefills=[PrefillSpan(2, 3, None, None)])
    assert not takes_step(x, mixed, [cache])
    assert not takes_step(torch.zeros(FUSED_MAX_ROWS + 1, 64, dtype=torch.bfloat16), decode, [cache])
    fp32_cache = LayerKV.allocate(64, 2, 16, torch.float32, torch.device("cpu"))
    assert not takes_step(x, decode, [fp32_cache])  # a cache in another dtype takes the generic write


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lora_rows_run_in_the_stack_bit_identically(tiny_checkpoint, tmp_path, monkeypatch, dtype):
    """Decode rows of two adapters of different ranks (every projection adapted) and base rows in one step: each
    row adds its own adapter's delta inside the stack, as the layer path does."""
    import kvyard.models.decoder as decoder
    from tests.lora.adapters import make_adapter

    base = tiny_checkpoint("llama")
    every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    adapters = {"a": str(make_adapter(base, tmp_path / "a", seed=1, r=4, target_modules=every)),
                "b": str(make_adapter(base, tmp_path / "b", seed=2, r=8, target_modules=every))}
    calls: list[bool] = []
    run = decoder.run_decode_stack

    def counted(*args, **kwargs):
        calls.append(args[-1] is not None)
        return run(*args, **kwargs)

    monkeypatch.setattr(decoder, "run_decode_stack", counted)
    results = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("KVYARD_DECODE_STACK", flag)
        llm = LLM(config=EngineConfig(model=str(base), kv_cache_memory="16MiB", dtype=dtype, lora_adapters=adapters))
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0, logprobs=3, ignore_eos=True),
                            lora=[None, "a", "b", "a"])
        results[flag] = [(o.outputs[0].token_ids, [(lp.token_id, lp.logprob, lp.top) for lp in o.outputs[0].logprobs])
                         for o in outs]
    assert any(calls)  # the stack ran steps with adapter rows
    assert results["1"] == results["0"]


@pytest.mark.skipif(not cpu_kernels.int8_act_available(), reason="kvyard's AVX2 kernels are not built here")
@pytest.mark.parametrize("scheme", ["int8", "int4-g32-asym"])
def test_dynamic_quant_takes_the_same_int8_kernel(tiny_checkpoint, tmp_path, monkeypatch, scheme):
    """--dynamic-quant: the stack rounds a step's rows to int8 with the layer path's kernel, so steps agree bit for
    bit; one row keeps the exact kernel in both."""
    out = tmp_path / scheme
    quantize_model(QuantizeOptions(model=str(tiny_checkpoint("qwen2")), scheme=scheme, out=out, dtype="float32",
                                   progress=False, max_seq_len=64, sensitivity=False, tool_eval=False,
                                   scaling="none"))
    r = _runs(out, monkeypatch, dtype="bfloat16", dynamic_quant=True)
    assert r["used"]
    assert r["stack"] == r["layers"]
    plain = _runs(out, monkeypatch, dtype="bfloat16")
    assert plain["stack"] != r["stack"]  # the switch changes the numbers: it did reach the kernels
