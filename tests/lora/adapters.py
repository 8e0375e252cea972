"""PEFT adapters for the tests: random (non-zero) LoRA weights over a tiny checkpoint, saved in PEFT's format."""

from pathlib import Path

import peft
import torch
import transformers


def make_adapter(base: Path, out: Path, seed: int = 0, **lora: object) -> Path:
    """A PEFT LoRA adapter of `base` with random A and B (PEFT's default init leaves B zero: no delta)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    settings = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "init_lora_weights": False,
                **lora}
    peft_model = peft.get_peft_model(model, peft.LoraConfig(**settings))
    with torch.no_grad():  # deltas as large as the base weights' own scale, so greedy tokens move
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(20.0)
    peft_model.save_pretrained(out)
    return out


def merged_reference(base: Path, adapter: Path) -> transformers.PreTrainedModel:
    """HF transformers with the adapter merged into its weights by PEFT: the oracle."""
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    return peft.PeftModel.from_pretrained(model, adapter).merge_and_unload().eval()
