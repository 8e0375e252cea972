"""DeepSeek's latent attention: the cache holds latents, not K and V, and a decode in the latent space (weight
absorption) equals attention over the keys and values the latents expand to. Parity with transformers for
deepseek_v2 and deepseek_v3 is in test_parity.py."""

import json
import shutil
from dataclasses import replace

import pytest
import torch

from kvyard import LLM
from kvyard.engine.kv_cache import bytes_per_block
from kvyard.errors import ConfigError, UnsupportedArchitectureError
from kvyard.loader.checkpoint import load_checkpoint
from kvyard.models.attention import AttentionMetadata
from kvyard.models.deepseek import DeepSeekModel, deinterleave


@pytest.fixture(scope="module")
def deepseek(tiny_checkpoint):
    return LLM(str(tiny_checkpoint("deepseek_v3")), dtype="float32", kv_cache_memory=1 << 20)


def test_the_cache_holds_one_latent_row_per_token(deepseek):
    cfg = deepseek.engine.model_config
    row = cfg.kv_lora_rank + cfg.head_dim  # 32 + 8
    for cache in deepseek.engine.runner.kv_caches:
        assert cache.k.shape[1:] == (1, row) and cache.v.data_ptr() == cache.k.data_ptr()
    per_token = bytes_per_block(cfg, 1, torch.float32)
    assert per_token == cfg.num_layers * row * 4
    # The same 4 heads with their own K (nope + rope = 24) and V (16) would keep 4x more.
    full = replace(cfg, kv_lora_rank=0, num_kv_heads=cfg.num_heads, head_dim=(16 + 8 + 16) // 2)
    assert bytes_per_block(full, 1, torch.float32) == 4 * per_token
    with pytest.raises(ConfigError, match="latent cache"):
        bytes_per_block(cfg, 16, torch.float32, "int8")


def test_a_decode_in_the_latent_space_equals_attention_over_expanded_keys(deepseek):
    model: DeepSeekModel = deepseek.engine.runner.model  # type: ignore[assignment]
    cfg, mla = model.cfg, model.layers[0].mla
    torch.manual_seed(0)
    block, lens = 4, [1, 5, 13]
    cache = deepseek.engine.runner.kv_caches[0]
    cache.k.normal_()
    tables = torch.tensor([[1, 2, 3, 4], [5, 6, 0, 0], [7, 8, 9, 10]])
    q = torch.randn(len(lens), cfg.num_heads, cfg.qk_nope_head_dim + cfg.head_dim)
    meta = AttentionMetadata(slot_mapping=torch.zeros(3, dtype=torch.long), block_size=block, num_decodes=3,
                             decode_blocks=tables, decode_lens=torch.tensor(lens))
    got = model._decode(q, cache, meta, mla)
    for r, n in enumerate(lens):
        slots = torch.tensor([int(tables[r, p // block]) * block + p % block for p in range(n)])
        rows = cache.k.index_select(0, slots)[:, 0]
        want = model._prefill(q[r : r + 1], rows, mla, torch.ones(1, n, dtype=torch.bool))
        torch.testing.assert_close(got[r : r + 1], want, atol=1e-5, rtol=1e-5)


def test_rotary_pairs_are_reordered_per_head():
    t = torch.arange(12).float().unsqueeze(1)  # two heads of [2 plain rows, 4 rotary rows]
    out = deinterleave(t, 2, 6, 6).squeeze(1).tolist()
    assert out == [0, 1, 2, 4, 3, 5, 6, 7, 8, 10, 9, 11]


def test_an_unsupported_rope_scaling_is_refused_by_name(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("deepseek_v3")
    dst = tmp_path / "dynamic"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0,
                              "original_max_position_embeddings": 128}
    (dst / "config.json").write_text(json.dumps(cfg))
    assert load_checkpoint(dst).config.rope_scaling["rope_type"] == "dynamic"
    with pytest.raises(UnsupportedArchitectureError, match="dynamic"):
        LLM(str(dst), dtype="float32")
