"""GGUF files: tiny ones converted like llama.cpp does, and the real default model against transformers."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from gguf import GGML_QUANT_SIZES, GGUFWriter
from gguf.quants import dequantize, quantize

from kvyard.errors import CheckpointError, UnsupportedArchitectureError
from kvyard.loader.checkpoint import Checkpoint, load_checkpoint
from kvyard.loader.gguf_file import gguf_metadata, load_gguf, open_reader, read_tensor, unpermute_qk
from kvyard.loader.hf_dir import expected_tensor_names
from kvyard.loader.registry import DEFAULT_MODEL, resolve_model
from kvyard.models.config import ModelConfig
from tests.loader.tiny_gguf import Q, gguf_name, hf_state_dict, llama_cpp_permute, write_tiny_gguf
from tests.tiny import CHAT_TEMPLATE, make_tiny_checkpoint

# Worst error of a quantized weight relative to the largest |w| in its row (one block scale, rounded).
TOLERANCE = {Q.F32: 0.0, Q.F16: 1e-3, Q.BF16: 8e-3, Q.Q8_0: 1 / 127, Q.Q5_0: 1 / 15, Q.Q5_1: 1 / 31}
TOLERANCE |= {Q.Q4_0: 1 / 7, Q.Q4_1: 1 / 15}

CASES = [  # (architecture, tied embeddings, weight type)
    ("llama", False, Q.F32),
    ("llama", True, Q.Q8_0),
    ("llama", False, Q.Q4_1),
    ("llama", True, Q.F16),
    ("qwen2", False, Q.Q4_0),
    ("qwen2", True, Q.BF16),
    ("qwen3", False, Q.Q5_0),
    ("qwen3", True, Q.Q5_1),
]
TEXTS = [
    "hello world",
    "def add(a, b):\n    return a + b\n",
    "Zwölf Boxkämpfer 日本語 🙂🚀",
    "  two  spaces\t",
]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, bool], Path]:
    root = tmp_path_factory.mktemp("hf")
    pairs = {(arch, tied) for arch, tied, _ in CASES}
    return {(a, t): make_tiny_checkpoint(root / f"{a}-{t}", a, tie_word_embeddings=t) for a, t in pairs}


@pytest.mark.parametrize(
    ("arch", "tied", "qtype"), CASES, ids=[f"{a}-{'tied' if t else 'untied'}-{q.name}" for a, t, q in CASES]
)
def test_tiny_gguf_matches_hf(hf_dirs: dict, tmp_path: Path, arch: str, tied: bool, qtype: Q) -> None:
    hf_dir = hf_dirs[(arch, tied)]
    ckpt = load_gguf(write_tiny_gguf(hf_dir, tmp_path / "tiny.gguf", qtype))
    orig = hf_state_dict(hf_dir)

    assert ckpt.config == ModelConfig.from_hf(json.loads((hf_dir / "config.json").read_text()))
    ours = dict(ckpt.tensors())
    assert set(ours) == set(expected_tensor_names(ckpt.config)) == set(orig)
    for name, t in ours.items():
        ref = orig[name]
        assert t.dtype == torch.float32 and tuple(t.shape) == ref.shape, name
        # Exactly what the quantized bytes hold (q/k un-permuted), and close to the original weight.
        q = qtype if ref.ndim == 2 else Q.F32
        stored = ref if q in (Q.F32, Q.F16) else dequantize(quantize(ref, q), q)
        if q == Q.F16:
            stored = ref.astype(np.float16).astype(np.float32)
        np.testing.assert_array_equal(t.numpy(), stored, err_msg=name)
        row_max = np.abs(ref).max(axis=-1, keepdims=True)
        assert np.all(np.abs(t.numpy() - ref) <= TOLERANCE[q] * row_max + 1e-7), name


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_gguf_tokenizer_and_template(hf_dirs: dict, tmp_path: Path, arch: str) -> None:
    hf_dir = hf_dirs[(arch, True) if (arch, True) in hf_dirs else (arch, False)]
    ckpt = load_gguf(write_tiny_gguf(hf_dir, tmp_path / "tiny.gguf", Q.Q8_0))
    ref = transformers.AutoTokenizer.from_pretrained(hf_dir)
    for text in [*TEXTS, "<|im_start|>user\nhi<|im_end|>"]:
        ids = ckpt.tokenizer.encode(text)
        assert ckpt.tokenizer.decode(ids) == text
        # transformers gives a qwen2/qwen3 GGUF Qwen2's split regex; the tiny vocab was trained with
        # GPT-2's, so only llama files are expected to split whitespace runs identically.
        if arch == "llama":
            assert ids == ref.encode(text), text
    assert ckpt.tokenizer.encode("<|im_start|><|im_end|>") == ref.encode("<|im_start|><|im_end|>")
    assert ckpt.tokenizer.chat_template == CHAT_TEMPLATE
    msgs = [{"role": "user", "content": "Zwölf 🙂"}]
    prompt = ckpt.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert prompt == ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)


def test_llama_permutation_agrees_with_transformers(hf_dirs: dict, tmp_path: Path) -> None:
    """transformers' GGUF loader un-permutes q/k with its own code: an independent reference."""
    path = write_tiny_gguf(hf_dirs[("llama", False)], tmp_path / "tiny.gguf", Q.Q8_0)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32
    )
    ref_sd = ref.state_dict()
    for name, t in load_gguf(path).tensors():
        assert torch.equal(t, ref_sd[name]), name


@pytest.mark.parametrize(("n_head", "n_kv"), [(4, 4), (4, 2), (9, 3)])
def test_unpermute_inverts_llama_cpp_permute(n_head: int, n_kv: int) -> None:
    head_dim, hidden = 8, 16
    q = np.random.default_rng(0).standard_normal((n_head * head_dim, hidden)).astype(np.float32)
    k = q[: n_kv * head_dim]
    np.testing.assert_array_equal(unpermute_qk(llama_cpp_permute(q, n_head), n_head), q)
    np.testing.assert_array_equal(unpermute_qk(llama_cpp_permute(k, n_head, n_kv), n_kv), k)
    assert not np.array_equal(llama_cpp_permute(q, n_head), q)


# Byte offsets of the fp16 scales in each K-quant block; random bytes there could be inf or NaN.
K_SCALE_OFFSETS = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def test_k_quants_agree_with_transformers_dequant(tmp_path: Path) -> None:
    from transformers.integrations.gguf.dequant import dequantize as hf_dequantize

    rng = np.random.default_rng(0)
    rows, cols = 3, 512
    path = tmp_path / "k.gguf"
    w = GGUFWriter(path, "llama")
    for qtype, offsets in K_SCALE_OFFSETS.items():
        block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
        blocks = rng.integers(0, 256, (rows * cols // block_elems, block_bytes), dtype=np.uint8)
        for off in offsets:
            scale = rng.uniform(0.001, 0.01, blocks.shape[0]).astype(np.float16)
            blocks[:, off : off + 2] = scale.view(np.uint8).reshape(-1, 2)
        w.add_tensor(qtype.name, blocks.reshape(rows, -1), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    for t in open_reader(path).tensors:
        ours = read_tensor(t)
        raw = torch.from_numpy(np.array(t.data)).reshape(-1)
        ref = hf_dequantize(raw, int(t.tensor_type)).reshape(rows, cols)
        assert ours.shape == (rows, cols) and torch.isfinite(ours).all()
        torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6, msg=t.name)


def test_unsupported_tensor_type(hf_dirs: dict, tmp_path: Path) -> None:
    hf_dir = hf_dirs[("llama", False)]
    bad = np.zeros((64, 128), dtype=np.int8)  # I8: gguf-py has no dequantizer for it
    path = write_tiny_gguf(hf_dir, tmp_path / "i8.gguf", replace={"blk.0.ffn_down.weight": bad})
    with pytest.raises(CheckpointError, match=r"i8\.gguf.*blk\.0\.ffn_down\.weight.*I8"):
        load_gguf(path)


def test_unsupported_architecture(hf_dirs: dict, tmp_path: Path) -> None:
    path = write_tiny_gguf(hf_dirs[("llama", False)], tmp_path / "gpt2.gguf", arch="gpt2")
    with pytest.raises(UnsupportedArchitectureError, match=r"gpt2\.gguf.*'gpt2'"):
        load_gguf(path)


def test_missing_tensor(hf_dirs: dict, tmp_path: Path) -> None:
    dropped = "blk.1.ffn_down.weight"
    path = write_tiny_gguf(hf_dirs[("llama", False)], tmp_path / "short.gguf", drop=(dropped,))
    with pytest.raises(
        CheckpointError, match=r"short\.gguf.*llama.*model\.layers\.1\.mlp\.down_proj\.weight"
    ):
        load_gguf(path)


def test_not_a_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(CheckpointError, match=r"junk\.gguf"):
        load_gguf(path)


def test_truncated_gguf(hf_dirs: dict, tmp_path: Path) -> None:
    path = write_tiny_gguf(hf_dirs[("llama", False)], tmp_path / "cut.gguf", Q.Q8_0)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 4096])
    with pytest.raises(CheckpointError, match=r"cut\.gguf"):
        load_gguf(path)


def test_gguf_metadata(hf_dirs: dict, tmp_path: Path) -> None:
    meta = gguf_metadata(write_tiny_gguf(hf_dirs[("qwen3", False)], tmp_path / "tiny.gguf"))
    assert meta["general.architecture"] == "qwen3" and meta["qwen3.block_count"] == 2
    assert meta["qwen3.attention.layer_norm_rms_epsilon"] == 1e-5  # float32 shown as written, not 9.99e-06
    assert meta["tokenizer.chat_template"] == CHAT_TEMPLATE
    assert "tokenizer.ggml.tokens" not in meta  # big arrays are left to the tokenizer


def test_writer_names_match_loader(hf_dirs: dict) -> None:
    # The helper's HF->GGUF map and the loader's GGUF->HF map must be inverse of each other.
    from kvyard.loader.gguf_file import hf_tensor_name

    for name in hf_state_dict(hf_dirs[("qwen3", False)]):
        assert hf_tensor_name(gguf_name(name)) == name


# ---- the real default model, against transformers' own GGUF loader ------------------------------


@pytest.fixture(scope="module")
def real_model() -> Path:
    return resolve_model(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def real_ckpt(real_model: Path) -> Checkpoint:
    return load_checkpoint(real_model)


def test_real_model_config(real_ckpt: Checkpoint, real_model: Path) -> None:
    cfg = real_ckpt.config
    assert (cfg.model_type, cfg.num_layers, cfg.hidden_size) == ("llama", 30, 576)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (9, 3, 64, 49152)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 100000.0 and cfg.intermediate_size == 1536
    assert cfg.eos_token_ids == (2,) and cfg.bos_token_id == 1
    assert real_ckpt.path == real_model and real_model.name == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_real_model_tensors_equal_transformers(real_ckpt: Checkpoint, real_model: Path) -> None:
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        real_model.parent, gguf_file=real_model.name, dtype=torch.float32
    )
    ref_sd = ref.state_dict()
    seen = set()
    for name, t in real_ckpt.tensors():
        seen.add(name)
        assert t.dtype == torch.float32 and t.shape == ref_sd[name].shape, name
        assert (t - ref_sd[name]).abs().max().item() <= 1e-6, name
    assert seen == set(ref_sd) - {"lm_head.weight"}


def test_real_model_tokenizer_equals_transformers(real_ckpt: Checkpoint, real_model: Path) -> None:
    ref = transformers.AutoTokenizer.from_pretrained(real_model.parent, gguf_file=real_model.name)
    tok = real_ckpt.tokenizer
    for text in TEXTS:
        assert tok.encode(text) == ref.encode(text), text
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    msgs = [{"role": "user", "content": "Write a haiku about caches. 🙂"}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True)
    assert ids == ref.apply_chat_template(msgs, add_generation_prompt=True)
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")
    assert tok.convert_tokens_to_ids("<|im_end|>") == 2 and tok.eos_token == "<|im_end|>"
