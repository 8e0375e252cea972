"""An HF transformers model built from kvyard's view of a checkpoint: the same weights kvyard serves (a GGUF file
dequantized by kvyard's reader), for the tools that train or fit on them (kvyard lora train, kvyard moe split)."""

from typing import Any

import torch

from kvyard.errors import KvyardError


def hf_causal_lm(hf_config: dict[str, Any], weights: dict[str, torch.Tensor]) -> Any:
    import transformers

    config = transformers.AutoConfig.for_model(**hf_config)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    missing, _ = model.load_state_dict(weights, strict=False)
    if [m for m in missing if m != "lm_head.weight"]:
        raise KvyardError(f"the checkpoint lacks {missing[:4]}")
    if config.tie_word_embeddings:
        model.tie_weights()
    return model
