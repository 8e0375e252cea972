"""Peers measured in the same run as kvyard: HF transformers generate and, if installed, llama.cpp."""

import time
from pathlib import Path

import torch


def load_hf_model(model_path: Path, dtype: torch.dtype):
    import transformers

    if model_path.suffix == ".gguf":
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(model_path.parent), gguf_file=model_path.name, dtype=torch.float32
        )
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    return model.to(dtype).eval()


@torch.inference_mode()
def hf_generate(model, prompts: list[list[int]], output_len: int, pad_id: int) -> float:
    """One padded static batch of greedy generation with EOS ignored; returns seconds."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as HF wants for decoder-only batching
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    start = time.perf_counter()
    out = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=output_len, min_new_tokens=output_len,
        do_sample=False, pad_token_id=pad_id,
    )
    elapsed = time.perf_counter() - start
    assert out.shape[1] - width == output_len
    return elapsed


def llama_cpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def llama_cpp_batch1(gguf_path: Path, prompts: list[list[int]], output_len: int, threads: int) -> dict:
    """Sequential generation through llama-cpp-python; returns throughput and inter-token latency."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf_path), n_ctx=2048, n_threads=threads, n_batch=512, verbose=False)
    itls: list[float] = []
    total_tokens = 0
    start = time.perf_counter()
    for prompt in prompts:
        llm.reset()
        last = None
        n = 0
        for _ in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            now = time.perf_counter()
            if last is not None:
                itls.append(now - last)
            last = now
            n += 1
            if n >= output_len:
                break
        total_tokens += n
    elapsed = time.perf_counter() - start
    itls.sort()
    return {"output_tokens_per_s": total_tokens / elapsed, "itl_ms_p50": 1000 * itls[len(itls) // 2]}
