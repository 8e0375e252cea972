"""`kvyard bench offline`: kvyard against its peers on the same weights and workload, in one run."""

import argparse
import json
import platform
import time

import torch

from kvyard.bench import peers
from kvyard.bench.workload import random_prompts
from kvyard.cli.engine_args import add_engine_args, engine_config_from_args
from kvyard.llm import LLM
from kvyard.sampling_params import SamplingParams


def add_offline_bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("offline", help="offline throughput and batch-1 latency against HF (and llama.cpp)")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--batch1-requests", type=int, default=2, help="requests run one at a time for batch-1 numbers")
    p.add_argument("--peers", default="hf", help="comma list of hf, llama.cpp, or none")
    p.add_argument("--json-out", default=None)
    add_engine_args(p)
    p.set_defaults(func=run_offline_bench)


def kvyard_batch1(llm: LLM, prompts: list[list[int]], output_len: int) -> dict:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    itls: list[float] = []
    tokens = 0
    start = time.perf_counter()
    for prompt in prompts:
        last = None
        for out in llm.stream(prompt, params):
            now = time.perf_counter()
            if last is not None:
                itls.append(now - last)
            last = now
            tokens += len(out.outputs[0].delta_token_ids)
    elapsed = time.perf_counter() - start
    itls.sort()
    return {"output_tokens_per_s": tokens / elapsed, "itl_ms_p50": 1000 * itls[len(itls) // 2]}


def kvyard_batch(llm: LLM, prompts: list[list[int]], output_len: int) -> dict:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    in_tokens = sum(len(p) for p in prompts)
    return {"seconds": elapsed, "output_tokens_per_s": out_tokens / elapsed,
            "total_tokens_per_s": (out_tokens + in_tokens) / elapsed}


def run_offline_bench(args: argparse.Namespace) -> int:
    cfg = engine_config_from_args(args)
    llm = LLM(config=cfg)
    prompts = random_prompts(llm.tokenizer, args.num_requests, args.input_len)
    single = prompts[: args.batch1_requests]
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    result: dict = {
        "model": str(llm.engine.model_path.name), "dtype": str(cfg.dtype).removeprefix("torch."),
        "workload": {"num_requests": args.num_requests, "input_len": args.input_len, "output_len": args.output_len},
        "machine": {"cpu_threads": torch.get_num_threads(), "platform": platform.platform()},
        "kvyard": {"batch": kvyard_batch(llm, prompts, args.output_len),
                   "batch1": kvyard_batch1(llm, single, args.output_len)},
    }
    wanted = {p.strip() for p in args.peers.split(",") if p.strip() and p.strip() != "none"}
    ratios: dict[str, float] = {}
    ky = result["kvyard"]
    if "hf" in wanted:
        model = peers.load_hf_model(llm.engine.model_path, cfg.dtype)
        pad = llm.tokenizer.pad_token_id if llm.tokenizer.pad_token_id is not None else 0
        peers.hf_generate(model, prompts[:2], 4, pad)  # warm-up
        batch_s = peers.hf_generate(model, prompts, args.output_len, pad)
        single_s = sum(peers.hf_generate(model, [p], args.output_len, pad) for p in single)
        result["hf"] = {
            "batch": {"seconds": batch_s, "output_tokens_per_s": args.num_requests * args.output_len / batch_s},
            "batch1": {"output_tokens_per_s": len(single) * args.output_len / single_s},
        }
        del model
        ratios["batch_throughput_vs_hf_padded"] = (
            ky["batch"]["output_tokens_per_s"] / result["hf"]["batch"]["output_tokens_per_s"])
        ratios["batch1_throughput_vs_hf"] = (
            ky["batch1"]["output_tokens_per_s"] / result["hf"]["batch1"]["output_tokens_per_s"])
    if "llama.cpp" in wanted:
        if llm.engine.model_path.suffix != ".gguf" or not peers.llama_cpp_available():
            result["llama.cpp"] = "skipped: needs llama-cpp-python and a GGUF model"
        else:
            lc = peers.llama_cpp_batch1(llm.engine.model_path, single, args.output_len, torch.get_num_threads())
            result["llama.cpp"] = {"batch1": lc}
            ratios["batch1_itl_vs_llama_cpp"] = ky["batch1"]["itl_ms_p50"] / lc["itl_ms_p50"]
    result["ratios"] = ratios
    text = json.dumps(result, indent=2)
    print(text)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(text + "\n")
    return 0
