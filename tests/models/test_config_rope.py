import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from kvyard.errors import CheckpointError, UnsupportedArchitectureError
from kvyard.models.config import ModelConfig
from kvyard.models.rope import attention_factor, inverse_frequencies

BASE = dict(vocab_size=100, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=131072, rope_theta=500000.0)


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 8192},
        {"rope_type": "linear", "factor": 4.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
        {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 16,
         "beta_slow": 2, "mscale": 1.0, "mscale_all_dim": 0.8},
        {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096, "attention_factor": 1.3,
         "truncate": False},
    ],
)
def test_scaled_frequencies_match_transformers(scaling):
    hf_cfg = transformers.LlamaConfig(**BASE, rope_scaling=dict(scaling))
    ref, ref_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf_cfg)
    cfg = ModelConfig.from_hf(hf_cfg.to_dict())
    torch.testing.assert_close(inverse_frequencies(cfg), ref.float(), rtol=1e-6, atol=0)
    assert attention_factor(cfg) == pytest.approx(ref_factor or 1.0, rel=1e-12)


def test_unsupported_scaling_is_refused():
    cfg = ModelConfig.from_hf({**BASE, "model_type": "llama", "rope_scaling": {"rope_type": "longrope", "factor": 4.0}})
    with pytest.raises(UnsupportedArchitectureError, match="longrope"):
        inverse_frequencies(cfg)


def test_architecture_switches():
    q2 = ModelConfig.from_hf({**BASE, "model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": False})
    q3 = ModelConfig.from_hf({**BASE, "model_type": "qwen3", "head_dim": 128})
    assert q2.attention_bias and not q2.qk_norm and q2.max_position_embeddings == 131072
    assert q3.qk_norm and q3.head_dim == 128


def test_mistral_window_slides_in_every_layer_and_keeps_the_context():
    cfg = ModelConfig.from_hf({**BASE, "model_type": "mistral", "sliding_window": 4096})
    assert cfg.max_position_embeddings == 131072 and cfg.layer_windows == (4096,) * cfg.num_layers


def test_gemma3_layer_kinds_and_rope_bases_from_either_config_layout():
    base = {**BASE, "model_type": "gemma3_text", "num_hidden_layers": 12, "sliding_window": 512, "head_dim": 256}
    old = ModelConfig.from_hf({**base, "rope_theta": 1e6, "rope_local_base_freq": 1e4, "query_pre_attn_scalar": 256})
    new = ModelConfig.from_hf({**base, "query_pre_attn_scalar": 256, "rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}})
    for cfg in (old, new):
        assert cfg.layer_windows == ((512,) * 5 + (None,)) * 2  # every sixth layer is global
        assert (cfg.rope_theta, cfg.local_rope_theta, cfg.rope_scaling) == (1e6, 1e4, None)
        assert cfg.attention_scale == 256**-0.5 and cfg.tie_word_embeddings
    with pytest.raises(UnsupportedArchitectureError, match="attn_logit_softcapping"):
        ModelConfig.from_hf({**base, "attn_logit_softcapping": 50.0})


def test_missing_fields_and_unknown_types_name_the_source():
    with pytest.raises(CheckpointError, match="cfg.json.*hidden_size"):
        ModelConfig.from_hf({"model_type": "llama", "vocab_size": 3}, source="cfg.json")
    with pytest.raises(UnsupportedArchitectureError, match="cfg.json.*bert"):
        ModelConfig.from_hf({"model_type": "bert", "architectures": ["BertModel"]}, source="cfg.json")
