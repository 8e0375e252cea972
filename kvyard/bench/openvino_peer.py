"""OpenVINO GenAI, Intel's CPU LLM engine, as a peer of `kvyard bench offline --peers openvino`.

`make openvino-peer` builds a venv of its own (.peers-openvino: openvino-genai, openvino-tokenizers,
optimum-intel, nncf) and runs `export` below. The model goes GGUF -> a bf16 HF directory with kvyard's own
tokenizer (kvyard/bench/hf_export.py; optimum-intel's transformers would convert the GGUF vocabulary wrongly)
-> OpenVINO IR by `optimum-cli export openvino`, in three weight formats:
- fp16: the dequantized weights; OpenVINO runs them at its inference precision (bf16 where the CPU has it);
- int8: per-channel weights;
- int4: groups of 32 weights, asymmetric, as the GGUF's Q4_1 blocks, every layer (`--ratio 1.0`).

    python -m kvyard.bench.openvino_peer export smollm2-135m [fp16,int8,int4]   # prints the IR directories

Each format runs in a worker process under the peer venv's Python (kvyard/bench/openvino_worker.py).
"""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from kvyard.bench.hf_export import dequantized_hf_dir
from kvyard.bench.peers import JsonLinePeer, batch1_figures
from kvyard.bench.workload import Workload

VENV = Path(".peers-openvino")
EXPORT_FLAGS = {
    "fp16": ["--weight-format", "fp16"],
    "int8": ["--weight-format", "int8"],
    "int4": ["--weight-format", "int4", "--group-size", "32", "--ratio", "1.0"],
}
# The format that stores what kvyard runs: a dequantized model against fp16 and int8, kvyard's own low-bit
# GGUF blocks (`--quantization gguf`) against int4.
PAIRED_FORMATS = {"dense": ("fp16", "int8"), "gguf": ("int4",)}


def python() -> Path:
    return (VENV / "bin" / "python").absolute()  # not resolve(): the venv is its link, not the base Python


def installed() -> bool:
    return python().exists() and (VENV / "bin" / "optimum-cli").exists()


def default_formats(quantization: str | None) -> tuple[str, ...]:
    return PAIRED_FORMATS["gguf" if quantization == "gguf" else "dense"]


def parse_formats(text: str, quantization: str | None) -> tuple[str, ...]:
    if text == "auto":
        return default_formats(quantization)
    formats = tuple(f.strip() for f in text.split(",") if f.strip())
    unknown = [f for f in formats if f not in EXPORT_FLAGS]
    if unknown or not formats:
        raise ValueError(f"--openvino-formats: unknown {unknown or text!r}; choose from {', '.join(EXPORT_FLAGS)}")
    return formats


def ir_dir(model: str, fmt: str) -> Path:
    return VENV / "models" / f"{Path(model).name.removesuffix('.gguf')}-{fmt}"


def export_command(hf_dir: Path, fmt: str, out: Path) -> list[str]:
    return [str(VENV / "bin" / "optimum-cli"), "export", "openvino", "--model", str(hf_dir),
            "--task", "text-generation-with-past", *EXPORT_FLAGS[fmt], str(out)]


def export(model: str, formats: tuple[str, ...]) -> dict[str, Path]:
    """OpenVINO IR directories of `model` (model, tokenizer and detokenizer), one per format, made once."""
    if not installed():
        raise RuntimeError(f"OpenVINO peer not installed in {VENV}: run `make openvino-peer`")
    hf = dequantized_hf_dir(model, VENV / "models" / "hf")
    dirs = {}
    for fmt in formats:
        out = ir_dir(model, fmt)
        if not (out / "openvino_model.xml").exists():
            partial = out.with_name(out.name + ".partial")
            subprocess.run(export_command(hf, fmt, partial), check=True)
            if not (partial / "openvino_detokenizer.xml").exists():  # optimum converts it when it can
                subprocess.run([str(VENV / "bin" / "convert_tokenizer"), str(hf), "--with-detokenizer",
                                "-o", str(partial)], check=True)
            partial.rename(out)
        dirs[fmt] = out
    return dirs


def logits(model_dir: Path, sequences: list[list[int]], threads: int) -> tuple[list[torch.Tensor], str]:
    """Every position's logits [len, vocab] of each sequence from the IR model in `model_dir`
    (kvyard/bench/openvino_logits.py under the peer venv), and the inference precision it ran at."""
    script = Path(__file__).with_name("openvino_logits.py")
    with tempfile.TemporaryDirectory(prefix="kvyard-openvino-logits-") as tmp:
        seqs = Path(tmp) / "sequences.json"
        seqs.write_text(json.dumps(sequences))
        proc = subprocess.run([str(python()), str(script), str(model_dir), str(threads), str(seqs), tmp],
                              capture_output=True, text=True, timeout=3600)
        lines = proc.stdout.strip().splitlines()
        reply = json.loads(lines[-1]) if lines else {"error": proc.stderr.strip()[-2000:] or f"exit {proc.returncode}"}
        if "error" in reply:
            raise RuntimeError(f"OpenVINO logits from {model_dir}: {reply['error']}")
        return [torch.from_numpy(np.load(Path(tmp) / f"{i}.npy")) for i in range(len(sequences))], \
            reply["inference_precision"]


class OpenVINOPeer(JsonLinePeer):
    """One IR format in OpenVINO's continuous-batching pipeline, with kvyard's token budget and KV cache size."""

    def __init__(self, model_dir: Path, threads: int, max_num_batched_tokens: int, kv_cache_gb: int,
                 kv_precision: str | None = None):
        """`kv_precision`: the plugin's KV_CACHE_PRECISION (u8, bf16, f16, f32); None leaves the pipeline's own."""
        self.model_dir = model_dir
        worker = Path(__file__).with_name("openvino_worker.py")
        super().__init__([str(python()), str(worker), str(model_dir), str(threads), str(max_num_batched_tokens),
                          str(kv_cache_gb), *([kv_precision] if kv_precision else [])])
        self.inference_precision: str = self.ready["inference_precision"]
        self.kv_cache_precision = kv_precision or "default"

    def batch(self, work: Workload) -> tuple[float, list[list[int]]]:
        """All prompts at once: (seconds, the generated token ids of each)."""
        reply = self.request({"op": "batch", "prompts": work.prompts, "output_lens": work.output_lens})
        if reply["tokens"] != work.output_tokens:
            raise RuntimeError(f"OpenVINO made {reply['tokens']} tokens, {work.output_tokens} were asked for")
        return reply["seconds"], reply["token_ids"]

    def batch1(self, work: Workload) -> dict:
        return batch1_figures(self.request({"op": "batch1", "prompts": work.prompts,
                                            "output_lens": work.output_lens}))


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4) or sys.argv[1] != "export":
        sys.exit("usage: python -m kvyard.bench.openvino_peer export MODEL [fp16,int8,int4]")
    chosen = parse_formats(sys.argv[3] if len(sys.argv) == 4 else "fp16,int8,int4", None)
    for path in export(sys.argv[2], chosen).values():
        print(path)
