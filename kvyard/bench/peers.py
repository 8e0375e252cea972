"""Peers measured in the same run as kvyard: HF transformers generate and, if installed, llama.cpp."""

import json
import multiprocessing
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

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


class HFPeer:
    """HF transformers generate, by default in a process of its own (spawned, not forked).

    There it runs as its users run it: with glibc's default malloc settings, which kvyard's engine changes
    for its own process (kvyard/engine/host_memory.py), and with a heap and caches that kvyard's engine does
    not share. `own_process=False` runs it inside the caller's process instead, under kvyard's settings
    (HF's padded batch took ~15 % less time with them: 100-170k page faults per batch fewer).
    """

    def __init__(self, model_path: Path, dtype: torch.dtype, threads: int, own_process: bool = True):
        self._model = None
        self._conn: Connection | None = None
        if not own_process:
            self._model = load_hf_model(model_path, dtype)
            return
        ctx = multiprocessing.get_context("spawn")  # a fork would inherit the parent's malloc settings
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve_hf, args=(child, model_path, dtype, threads), daemon=True)
        self._proc.start()
        self._call("ready")

    def _call(self, op: str, *args: Any) -> Any:
        if self._model is not None:
            return _HF_OPS[op](self._model, *args)
        assert self._conn is not None
        self._conn.send((op, args))
        ok, result = self._conn.recv()
        if not ok:
            raise RuntimeError(f"HF peer process: {result}")
        return result

    def static_batch(self, work: Workload, pad_id: int) -> float:
        return self._call("static_batch", work, pad_id)

    def one_at_a_time(self, work: Workload, pad_id: int) -> float:
        return self._call("one_at_a_time", work, pad_id)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.send(("stop", ()))
            self._proc.join(timeout=30)
            self._conn = None


_HF_OPS = {"static_batch": hf_static_batch, "one_at_a_time": hf_one_at_a_time}


def _serve_hf(conn: Connection, model_path: Path, dtype: torch.dtype, threads: int) -> None:
    torch.set_num_threads(threads)
    model = load_hf_model(model_path, dtype)
    while True:
        op, args = conn.recv()
        if op == "stop":
            return
        try:
            conn.send((True, None if op == "ready" else _HF_OPS[op](model, *args)))
        except Exception as exc:  # reported to the caller, which raises it
            conn.send((False, f"{type(exc).__name__}: {exc}"))


# Where `make peers` installs llama-cpp-python: a venv of its own, beside the repository's .venv.
PEERS_PYTHON = Path(__file__).resolve().parents[2] / ".peers-venv" / "bin" / "python"


def llama_cpp_python() -> str | None:
    """A Python that imports llama_cpp: this one, else the peers venv's; None when there is neither."""
    for python in (sys.executable, str(PEERS_PYTHON)):
        if Path(python).exists() and subprocess.run([python, "-c", "import llama_cpp"], capture_output=True).returncode == 0:
            return python
    return None


class JsonLinePeer:
    """A peer engine in a process of its own, under another venv's Python: one JSON line in per job, one out.

    The worker prints {"ready": true, ...} once loaded and {"error": "..."} when it fails."""

    def __init__(self, argv: list[str]):
        self._proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.ready = self._read()

    def _read(self) -> dict:
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        reply = json.loads(line) if line else {"error": f"exited with {self._proc.wait()}"}
        if "error" in reply:
            raise RuntimeError(f"peer process {Path(self._proc.args[1]).name}: {reply['error']}")
        return reply

    def request(self, job: dict) -> dict:
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps(job) + "\n")
        self._proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()


def batch1_figures(reply: dict) -> dict:
    """A worker's one-at-a-time reply ({"tokens", "seconds", "itls"}) as the bench's batch-1 figures."""
    itls = sorted(reply["itls"])
    return {"output_tokens": reply["tokens"], "output_tokens_per_s": reply["tokens"] / reply["seconds"],
            "itl_ms_p50": 1000 * itls[len(itls) // 2]}


class LlamaCppPeer(JsonLinePeer):
    """llama-cpp-python on a GGUF file, generating one prompt at a time as its Python API offers, in a process of
    its own under `python` (kvyard/bench/llama_cpp_worker.py): llama-cpp-python usually lives in another venv."""

    def __init__(self, gguf_path: Path, threads: int, python: str):
        super().__init__([python, str(Path(__file__).with_name("llama_cpp_worker.py")), str(gguf_path), str(threads)])

    def batch1(self, work: Workload) -> dict:
        return batch1_figures(self.request({"prompts": work.prompts, "output_lens": work.output_lens}))
