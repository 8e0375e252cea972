"""A kvyard model as a plain HF directory, for peers that read only HF checkpoints (vLLM-CPU, OpenVINO).

kvyard's models here are GGUF files. `dequantized_hf_dir` dequantizes one through HF transformers into bf16
safetensors, the weights kvyard serves in bf16, and saves beside them the tokenizer kvyard itself uses (this
venv's transformers' conversion of the GGUF vocabulary), so a peer with an older transformers does not convert
the vocabulary again, differently.
"""

from pathlib import Path


def dequantized_hf_dir(model: str, root: Path) -> Path:
    """`root/<model name>`: an HF directory (bf16 safetensors, tokenizer, chat template) of `model`, made once.
    A model that is already an HF directory is returned as it is."""
    import torch
    import transformers

    from kvyard.loader.registry import resolve_model

    out = root / Path(model).name.removesuffix(".gguf")
    if (out / "config.json").exists():
        return out
    src = resolve_model(model)
    if src.is_dir():
        return src
    dense = transformers.AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name,
                                                              dtype=torch.float32)
    config = dense.config
    config.__dict__.pop("quantization_config", None)  # dequantized: a model HF can save, and peers read
    model_bf16 = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model_bf16.load_state_dict({k: v.to(torch.bfloat16) for k, v in dense.state_dict().items()})
    partial = out.with_name(out.name + ".partial")
    model_bf16.save_pretrained(str(partial))
    transformers.AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name).save_pretrained(str(partial))
    partial.rename(out)
    return out
