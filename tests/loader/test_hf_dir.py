"""HF checkpoint directories: tensors equal transformers' own state_dict; every broken input is a typed error."""

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from kvyard.errors import CheckpointError, UnsupportedArchitectureError
from kvyard.loader.checkpoint import load_checkpoint
from kvyard.loader.hf_dir import expected_tensor_names, load_hf_dir
from kvyard.models.config import ModelConfig
from tests.tiny import CHAT_TEMPLATE, make_tiny_checkpoint

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, bool], Path]:
    root = tmp_path_factory.mktemp("hf")
    return {
        (arch, tied): make_tiny_checkpoint(root / f"{arch}-{tied}", arch, tie_word_embeddings=tied)
        for arch in ARCHS
        for tied in (False, True)
    }


def _copy(src: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(src, tmp_path / src.name))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("arch", ARCHS)
def test_tensors_equal_transformers_state_dict(tiny_dirs: dict, arch: str, tied: bool) -> None:
    path = tiny_dirs[(arch, tied)]
    ckpt = load_hf_dir(path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path).state_dict()
    ours = dict(ckpt.tensors())

    assert set(ours) == set(expected_tensor_names(ckpt.config))
    assert ("lm_head.weight" in ours) is not tied
    expected = {k for k in ref if not (tied and k == "lm_head.weight")}
    assert set(ours) == expected
    for name, t in ours.items():
        assert t.dtype == ref[name].dtype, name
        assert torch.equal(t, ref[name]), name
    if arch == "qwen2":
        assert "model.layers.0.self_attn.q_proj.bias" in ours
    if arch == "qwen3":
        assert "model.layers.1.self_attn.k_norm.weight" in ours


@pytest.mark.parametrize("arch", ARCHS)
def test_config_and_tokenizer(tiny_dirs: dict, arch: str) -> None:
    path = tiny_dirs[(arch, True)]
    ckpt = load_hf_dir(path)
    hf = transformers.AutoConfig.from_pretrained(path)
    assert ckpt.config == ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    assert ckpt.config.num_layers == hf.num_hidden_layers
    assert ckpt.config.tie_word_embeddings
    assert ckpt.hf_config["model_type"] == arch
    ref_tok = transformers.AutoTokenizer.from_pretrained(path)
    text = "def add(a, b):\n    return a + b  # Zwölf 🙂"
    assert ckpt.tokenizer.encode(text) == ref_tok.encode(text)
    assert ckpt.tokenizer.chat_template == CHAT_TEMPLATE


def test_load_checkpoint_dispatches_to_hf_dir(tiny_dirs: dict) -> None:
    ckpt = load_checkpoint(tiny_dirs[("llama", False)])
    assert ckpt.config.model_type == "llama"


def test_sharded_checkpoint(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path / "sharded", "qwen2", max_shard_size="40KB")
    shards = sorted(path.glob("*.safetensors"))
    assert len(shards) > 2 and (path / "model.safetensors.index.json").exists()
    ref = transformers.AutoModelForCausalLM.from_pretrained(path).state_dict()
    ours = dict(load_hf_dir(path).tensors())
    assert set(ours) == set(ref)
    for name, t in ours.items():
        assert torch.equal(t, ref[name]), name


def test_missing_shard(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(tmp_path / "sharded", "llama", max_shard_size="40KB")
    victim = sorted(path.glob("*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=victim.name):
        load_hf_dir(path)


def test_missing_config(tiny_dirs: dict, tmp_path: Path) -> None:
    path = _copy(tiny_dirs[("llama", False)], tmp_path)
    (path / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json"):
        load_hf_dir(path)


def test_invalid_config_json(tiny_dirs: dict, tmp_path: Path) -> None:
    path = _copy(tiny_dirs[("llama", False)], tmp_path)
    (path / "config.json").write_text('{"model_type": "llama",')
    with pytest.raises(CheckpointError, match=r"config\.json.*not valid JSON"):
        load_hf_dir(path)


def test_truncated_safetensors(tiny_dirs: dict, tmp_path: Path) -> None:
    path = _copy(tiny_dirs[("llama", False)], tmp_path)
    f = path / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_hf_dir(path)


def test_garbage_safetensors(tiny_dirs: dict, tmp_path: Path) -> None:
    path = _copy(tiny_dirs[("llama", False)], tmp_path)
    (path / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_hf_dir(path)


def test_missing_tensor(tiny_dirs: dict, tmp_path: Path) -> None:
    path = _copy(tiny_dirs[("llama", False)], tmp_path)
    f = path / "model.safetensors"
    tensors = load_file(f)
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as e:
        load_hf_dir(path)
    msg = str(e.value)
    assert str(path) in msg and "LlamaForCausalLM" in msg
    assert "model.layers.1.mlp.down_proj.weight" in msg


def test_unknown_model_type(tiny_dirs: dict, tmp_path: Path) -> None:
    path = _copy(tiny_dirs[("llama", False)], tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError, match=r"config\.json.*GPT2LMHeadModel"):
        load_hf_dir(path)


def test_mlp_bias_is_unsupported(tiny_dirs: dict, tmp_path: Path) -> None:
    path = _copy(tiny_dirs[("llama", False)], tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["mlp_bias"] = True
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError, match="mlp_bias"):
        load_hf_dir(path)


def test_missing_tokenizer(tiny_dirs: dict, tmp_path: Path) -> None:
    path = _copy(tiny_dirs[("llama", False)], tmp_path)
    (path / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        load_hf_dir(path)


def test_not_a_directory(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="nowhere"):
        load_hf_dir(tmp_path / "nowhere")
