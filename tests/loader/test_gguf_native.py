"""`--quantization gguf`: a GGUF file's Q4_0/Q4_1/Q4_K/Q5_0/Q5_1/Q8_0 layers load as kvyard's int4/int8 forms in groups
of 32 with the file's own codes, scales and offsets, so the model computes with exactly the weights the file holds."""

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGUFWriter
from gguf.quants import dequantize

from kvyard.config import EngineConfig
from kvyard.errors import ConfigError
from kvyard.llm import LLM
from kvyard.loader.checkpoint import load_checkpoint
from kvyard.loader.gguf_file import open_reader
from kvyard.loader.gguf_native import INT4_MIN, INT8, SCHEMES, group_codes, read_native, with_offset
from kvyard.loader.registry import DEFAULT_MODEL, resolve_model
from kvyard.models.decoder import DecoderModel
from kvyard.quant.fidelity import batch_logits
from kvyard.quant.qtensor import QuantizedTensor
from kvyard.sampling_params import SamplingParams
from tests.loader.tiny_gguf import Q, write_tiny_gguf
from tests.tiny import make_tiny_checkpoint

SCALE_OFFSETS = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q4_K: (0, 2), Q.Q8_0: (0,), Q.Q5_0: (0,), Q.Q5_1: (0, 2)}  # the fp16 scale (and min) bytes of a block
ROWS, COLS = 4, 512


def random_blocks(qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """Random codes (and 6-bit Q4_K scales) under finite fp16 scales; the first two blocks get a zero scale,
    block 0 with a zero minimum too, so that constant groups (0 and not) are covered."""
    elems, size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (ROWS * COLS // elems, size), dtype=np.uint8)
    for off in SCALE_OFFSETS[qtype]:
        scale = rng.uniform(-0.02, 0.02, blocks.shape[0]).astype(np.float16)
        scale[:2] = 0
        blocks[:, off:off + 2] = scale.view(np.uint8).reshape(-1, 2)
    blocks[0, 2:4] = 0  # Q4_1's min, Q4_K's dmin
    return blocks


@pytest.mark.parametrize("qtype", list(SCALE_OFFSETS), ids=lambda q: q.name)
def test_blocks_give_back_what_gguf_dequantizes(qtype: Q, tmp_path: Path) -> None:
    blocks = random_blocks(qtype, np.random.default_rng(int(qtype)))
    ref = dequantize(blocks, qtype).reshape(ROWS, COLS)
    codes, scale, offset = group_codes(blocks, qtype)
    scheme = SCHEMES[qtype]
    assert codes.min() >= -(1 << (scheme.bits - 1)) and codes.max() < 1 << (scheme.bits - 1)
    if qtype in (Q.Q5_0, Q.Q5_1):
        assert codes.min() >= -16 and codes.max() <= 15
    groups = np.repeat(scale, 32) * codes + (0 if offset is None else np.repeat(offset, 32))
    np.testing.assert_allclose(groups.reshape(ROWS, COLS), ref, rtol=1e-6, atol=1e-9)
    # Through a file, as the loader reads it, and into kvyard's form: w = (q - zero_point) * scale.
    path = tmp_path / "b.gguf"
    w = GGUFWriter(path, "llama")
    w.add_tensor("w", blocks.reshape(ROWS, -1), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    qt = read_native(open_reader(path).tensors[0])
    assert qt.scheme == scheme and qt.shape == (ROWS, COLS) and qt.q.dtype == torch.int8
    assert int(qt.q.min()) >= scheme.qmin - (scheme.bits == 8) and int(qt.q.max()) <= scheme.qmax
    got = qt.dequantize()
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, torch.from_numpy(ref), rtol=1e-5, atol=1e-8)


def test_constant_groups() -> None:
    """A group with scale 0 is its offset everywhere, whether that offset is 0 or not."""
    codes = torch.randint(-8, 8, (2, 64), dtype=torch.int8)
    scale = torch.tensor([[0.0, 0.5], [0.0, 0.25]])
    offset = torch.tensor([[0.0, -1.0], [-0.75, 2.0]])
    w = with_offset(INT4_MIN, codes, scale, offset).dequantize()
    assert (w[0, :32] == 0).all() and (w[1, :32] == -0.75).all()
    torch.testing.assert_close(w[:, 32:], codes[:, 32:].float() * scale[:, 1:] + offset[:, 1:])


@pytest.fixture(scope="module", params=[Q.Q8_0, Q.F16], ids=["head-Q8_0", "head-F16"])
def q4_gguf(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama (q/k rows permuted by the converter; its own head) in Q4_1, with layer 0's v_proj in Q8_0,
    layer 1's q|k|v in Q5_0 and its gate|up in Q5_1, its down_proj in F16, and the head in Q8_0 (kept) or F16."""
    root = tmp_path_factory.mktemp("native")
    hf = make_tiny_checkpoint(root / "hf", "llama")
    qtypes = {"blk.0.attn_v.weight": Q.Q8_0, "output.weight": request.param, "blk.1.ffn_down.weight": Q.F16}
    qtypes |= {f"blk.1.attn_{x}.weight": Q.Q5_0 for x in "qkv"} | {f"blk.1.ffn_{x}.weight": Q.Q5_1 for x in ("gate", "up")}
    return write_tiny_gguf(hf, root / "q4.gguf", Q.Q4_1, qtypes=qtypes)


def test_fused_units_keep_their_blocks_only_when_their_members_share_a_form(q4_gguf: Path) -> None:
    ckpt = load_checkpoint(q4_gguf)
    dense = dict(ckpt.tensors())
    assert ckpt.native_tensors is not None
    native = dict(ckpt.native_tensors())
    assert set(native) == set(dense)
    kept = {name: t for name, t in native.items() if isinstance(t, QuantizedTensor)}
    head_type = next(t.tensor_type for t in open_reader(q4_gguf).tensors if t.name == "output.weight")
    head_kept = isinstance(native["lm_head.weight"], QuantizedTensor)
    assert head_kept == (head_type == Q.Q8_0)
    # every linear (7 a layer) and a Q8_0 head, less layer 0's q|k|v (Q4_1 beside Q8_0) and layer 1's down (F16)
    assert ckpt.native_layers == len(kept) == 7 * ckpt.config.num_layers + head_kept - 3 - 1
    assert "model.layers.1.mlp.down_proj.weight" not in kept
    assert not any(n.startswith("model.layers.0.self_attn.") and n[-13:-7] in ("q_proj", "k_proj", "v_proj")
                   for n in kept)
    for name, qt in kept.items():  # q/k un-permuted like the dense rows
        if name.startswith("model.layers.1.self_attn.") and "o_proj" not in name or name == "lm_head.weight":
            assert qt.scheme == INT8, name  # Q5_0 and Q8_0
        elif name.startswith("model.layers.1.mlp."):
            assert qt.scheme.name == "int8-g32-min", name  # Q5_1
        else:
            assert qt.scheme == INT4_MIN, name  # Q4_1
        torch.testing.assert_close(qt.dequantize(), dense[name], rtol=1e-5, atol=1e-7, msg=name)


def test_the_model_computes_the_files_weights(q4_gguf: Path) -> None:
    """In float32 the kept layers give the dense model's logits and greedy tokens."""
    ckpt = load_checkpoint(q4_gguf)
    seqs = [[1, 5, 9, 2, 7, 3, 11, 4], [6, 2, 8]]
    logits = []
    for stream in (ckpt.tensors, ckpt.native_tensors):
        model = DecoderModel(ckpt.config, torch.float32, torch.device("cpu"), max_positions=64)
        model.load(stream(), str(ckpt.path))  # type: ignore[misc]
        with torch.inference_mode():
            logits.append(torch.cat(batch_logits(model, seqs)))
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-4)
    params = SamplingParams(max_tokens=12, temperature=0)
    tokens = [[o.outputs[0].token_ids for o in LLM(config=EngineConfig(model=str(q4_gguf), dtype="float32",
                                                                      quantization=q)).generate(
        ["hello world", "def add(a, b):"], params)] for q in (None, "gguf")]
    assert tokens[1] == tokens[0]


def test_gguf_quantization_needs_a_gguf_file(tiny_checkpoint) -> None:
    with pytest.raises(ConfigError, match="not a GGUF file"):
        LLM(config=EngineConfig(model=str(tiny_checkpoint("llama")), quantization="gguf"))


def test_real_model_layers_are_its_weights() -> None:
    """SmolLM2's file (Q4_1 linears, a Q8_0 embedding that is also the head): every linear kept in its blocks,
    the head in int8-g32 from the embedding's, each equal to its dequantized form."""
    ckpt = load_checkpoint(resolve_model(DEFAULT_MODEL))
    assert ckpt.native_layers == 7 * ckpt.config.num_layers + 1
    dense = dict(ckpt.tensors())
    dense["lm_head.weight"] = dense["model.embed_tokens.weight"]
    for name, t in ckpt.native_tensors():  # type: ignore[misc]
        if isinstance(t, QuantizedTensor):
            ref = dense[name]
            assert (t.dequantize() - ref).abs().max() <= 1e-6 * ref.abs().max(), name
