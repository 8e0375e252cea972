"""`kvyard bench lora`: many LoRA adapters in one batch against the base model alone, in one run (#39).

The same engine serves both: each round runs the base model over fresh prompts, then the same number of
requests spread over `--adapters` adapters (request i on adapter i mod N), all at once, and times the output
tokens a second. The adapters are random PEFT files of the model's shapes (`--rank`, `--targets`): what a
batch of them costs does not depend on what they learned. The ratio of the medians is the figure; every
round's ratio is printed beside it.
"""

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from kvyard.bench.output import emit_json, machine_info
from kvyard.config import EngineConfig
from kvyard.llm import LLM
from kvyard.lora.adapter import CONFIG_FILE, WEIGHTS_FILE, module_shape
from kvyard.models.config import ModelConfig
from kvyard.plan.model_spec import from_source
from kvyard.sampling_params import SamplingParams


def write_random_adapter(cfg: ModelConfig, out: Path, rank: int, targets: list[str], seed: int) -> Path:
    """A PEFT LoRA adapter of `cfg`'s shapes with small random A and B, at `out`."""
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for module in targets:
            rows, cols = module_shape(cfg, module)
            part = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            name = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[name + ".lora_A.weight"] = torch.randn(rank, cols, generator=g) * 0.02
            tensors[name + ".lora_B.weight"] = torch.randn(rows, rank, generator=g) * 0.02
    save_file(tensors, out / WEIGHTS_FILE)
    (out / CONFIG_FILE).write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                               "target_modules": targets}))
    return out


def _tok_s(llm: LLM, requests: int, input_len: int, output_len: int, seed: int,
           adapters: list[str | None]) -> float:
    vocab = llm.engine.model_config.vocab_size
    # every round's prompts its own, so that no round finds another's in the prefix cache
    prompts = [[(7 + 13 * (seed * requests + i) + 31 * j * (i + 1)) % (vocab - 2) + 1 for j in range(input_len)]
               for i in range(requests)]
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, lora=adapters)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def run_lora_bench(args: argparse.Namespace) -> int:
    targets = args.targets.split(",")
    cfg = from_source(args.model).config  # the shapes only: the engine loads the weights once, below
    root = Path(args.adapter_dir) / f"r{args.rank}-{'-'.join(targets)}"
    paths = {f"adapter-{i}": str(write_random_adapter(cfg, root / f"adapter-{i}", args.rank, targets, seed=i))
             for i in range(args.adapters)}
    llm = LLM(config=EngineConfig(model=args.model, dtype=args.dtype, lora_adapters=paths))
    spread: list[str | None] = [f"adapter-{i % args.adapters}" for i in range(args.num_requests)]
    rounds: list[dict[str, float]] = []
    for r in range(args.rounds):
        base = _tok_s(llm, args.num_requests, args.input_len, args.output_len, 2 * r, [None] * args.num_requests)
        mixed = _tok_s(llm, args.num_requests, args.input_len, args.output_len, 2 * r + 1, spread)
        rounds.append({"base_tok_s": base, "lora_tok_s": mixed, "ratio": mixed / base})
        print(f"round {r + 1}: base {base:.1f} tok/s, {args.adapters} adapters {mixed:.1f} tok/s "
              f"({mixed / base:.2f}x)", flush=True)
    base_median = statistics.median(r["base_tok_s"] for r in rounds)
    lora_median = statistics.median(r["lora_tok_s"] for r in rounds)
    result: dict[str, Any] = {
        "model": args.model, "dtype": args.dtype, "adapters": args.adapters, "rank": args.rank, "targets": targets,
        "requests": args.num_requests, "input_len": args.input_len, "output_len": args.output_len,
        "base_tok_s": base_median, "lora_tok_s": lora_median, "ratio": lora_median / base_median,
        "rounds": rounds, "machine": machine_info()}
    emit_json(result, args.json_out)
    return 0


def add_lora_bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("lora", help="requests spread over many LoRA adapters against the base model alone (#39)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--targets", default="q_proj,v_proj", help="the modules each adapter adapts (PEFT's default)")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--adapter-dir", default="bench-results/lora", help="where the random adapters are written")
    p.add_argument("--json-out")
    p.set_defaults(func=run_lora_bench)
