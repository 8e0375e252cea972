"""Peers measured in the same run as kvyard: HF transformers generate and, if installed, llama.cpp."""

import time
from pathlib import Path

import torch

from kvyard.bench.workload import Workload


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
def hf_static_batch(model, work: Workload, pad_id: int) -> float:
    """One padded static batch, greedy, EOS ignored; returns seconds.

    A static batch runs until its longest request is done, so it generates max(output_lens) tokens
    for every row; only the requested ones count as output.
    """
    prompts = work.prompts
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as HF wants for decoder-only batching
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    steps = max(work.output_lens)
    start = time.perf_counter()
    out = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
        do_sample=False, pad_token_id=pad_id,
    )
    elapsed = time.perf_counter() - start
    assert out.shape[1] - width == steps
    return elapsed


def hf_one_at_a_time(model, work: Workload, pad_id: int) -> float:
    return sum(hf_static_batch(model, Workload([p], [n]), pad_id) for p, n in zip(work.prompts, work.output_lens,
                                                                                  strict=True))


def llama_cpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


class LlamaCppPeer:
    """llama-cpp-python on the same GGUF: sequential generation, as its Python API offers."""

    def __init__(self, gguf_path: Path, threads: int):
        from llama_cpp import Llama

        self.llm = Llama(model_path=str(gguf_path), n_ctx=2048, n_threads=threads, n_batch=512, verbose=False)

    def batch1(self, work: Workload) -> dict:
        itls: list[float] = []
        tokens = 0
        start = time.perf_counter()
        for prompt, n_out in zip(work.prompts, work.output_lens, strict=True):
            last = None
            n = 0
            for _ in self.llm.generate(prompt, temp=0.0, top_k=1, reset=True):
                now = time.perf_counter()
                if last is not None:
                    itls.append(now - last)
                last = now
                n += 1
                if n >= n_out:
                    break
            tokens += n
        elapsed = time.perf_counter() - start
        itls.sort()
        return {"output_tokens_per_s": tokens / elapsed, "itl_ms_p50": 1000 * itls[len(itls) // 2]}
