"""`kvyard bench quant`: each quantization scheme against the unquantized model, in one run.

Fidelity (KL, top-1, perplexity, tool-call JSON) comes from `kvyard quantize` itself, in the compute dtype
(`--fidelity-dtype`, by default `--dtype`), and again from the saved checkpoint with both models in float32,
which isolates the weights' rounding from bf16's own activation rounding (`gguf`, a GGUF source with its own
blocks kept, and the baseline with it, are measured against the file's weights in float32: in float32 that
shows the blocks are read exactly).
Speed is decode tokens per second (speedups are against the unquantized model in the same dtype) with the
prompt already prefilled, at batch 1 and at batch 32, the models taking turns over `--repeats` rounds because
this machine is noisy.
"""

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvyard.bench import openvino_peer
from kvyard.bench.decode_steps import interleaved_decode_steps
from kvyard.bench.output import emit_json, machine_info
from kvyard.bench.workload import random_workload
from kvyard.config import EngineConfig, parse_dtype
from kvyard.llm import LLM
from kvyard.loader.registry import resolve_model
from kvyard.quant.awq import DEFAULT_SCALING, SCALINGS
from kvyard.quant.cli import add_head_scheme_arg
from kvyard.quant.fidelity import Fidelity
from kvyard.quant.plan import DEFAULT_PROTECT
from kvyard.quant.scheme import DEFAULT_ROUNDING, KEEP_GGUF, ROUNDINGS
from kvyard.quant.tool import (
    QuantizeOptions,
    QuantizeResult,
    Reference,
    kv_cache_fidelity,
    load_reference,
    quantize_model,
    saved_fidelity,
    served_fidelity,
    source_fidelity,
)
from kvyard.sampling_params import SamplingParams

KV_INT8 = "kv-int8"  # not a weight scheme: dense weights with the int8 KV cache
DYNAMIC_SUFFIX = "+dynamic-quant"  # a low-bit scheme served with --dynamic-quant (int8 activations)


def add_quant_bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("quant", help="quantization schemes vs bf16: KL, top-1, memory, decode speed")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--schemes", default="int8,int4-g128", help="comma list of weight schemes (mixed needs --kl-budget), kv-int8 for the int8 KV "
                   "cache, and gguf for a GGUF source's own blocks (--quantization gguf)")
    p.add_argument("--kl-budget", type=float, default=None, help="budget for the mixed plan")
    p.add_argument("--mixed-weight", default="int4-g128")
    p.add_argument("--protect", default=None,
                   help="comma-separated layers kept dense, as for kvyard quantize (default: lm_head; '' for none)")
    p.add_argument("--rounding", choices=ROUNDINGS, default=DEFAULT_ROUNDING,
                   help="weight rounding, as for kvyard quantize: rtn (round to nearest) or gptq")
    p.add_argument("--scaling", choices=SCALINGS, default=DEFAULT_SCALING,
                   help="as for kvyard quantize: auto, awq (activation-aware column scales) or none")
    p.add_argument("--outlier-columns", type=float, default=0.0,
                   help="as for kvyard quantize: share of each layer's input columns kept in full precision")
    add_head_scheme_arg(p)
    p.add_argument("--dynamic-quant", action="store_true",
                   help="also each low-bit scheme with int8 activations (--dynamic-quant): its KL and speed")
    p.add_argument("--openvino-formats", default="",
                   help="also the KL of OpenVINO's own IR models against the same fp32 model on the same text: "
                        "comma list of fp16, int8, int4 (needs `make openvino-peer`)")
    p.add_argument("--batch-sizes", default="1,32")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--decode-steps", type=int, default=32, help="timed decode steps per measurement")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16", help="compute dtype of every model timed")
    p.add_argument("--fidelity-dtype", default=None,
                   help="compute dtype while quantizing and measuring KL (default: --dtype); float32 keeps bf16's "
                   "own activation rounding out of the KL a mixed plan is held to")
    p.add_argument("--out-dir", default=None, help="keep the quantized checkpoints here (default: a temp dir)")
    p.add_argument("--json-out", default=None)
    p.set_defaults(func=run_quant_bench)


def weight_bytes(llm: LLM) -> int:
    """Bytes of every weight the model holds (dense tensors and low-bit layers)."""
    model = llm.engine.runner.model
    seen: set[int] = set()
    total = 0
    tensors = [model.embed, model.final_norm, model.lm_head]
    for layer in model.layers:
        tensors += list(vars(layer).values())
    for t in tensors:
        if t is None or id(t) in seen:
            continue
        seen.add(id(t))
        total += t.nbytes  # a tensor, or a low-bit layer reporting its packed bytes
    return total


def kv_bytes_per_token(llm: LLM) -> int:
    caches = llm.engine.runner.kv_caches
    return sum(c.nbytes for c in caches) // caches[0].k.shape[0]


def decode_rates(llms: dict[str, LLM], batch: int, input_len: int, steps: int) -> dict[str, float]:
    """Decode tokens per second of `batch` running requests in each engine, measured after all prompts are
    prefilled, the engines taking turns step by step (interleaved_decode_steps); from the median step time, so
    that a step the VM stalled does not count."""
    first = next(iter(llms.values()))
    work = random_workload(first.tokenizer, batch, input_len, 1, seed=batch)
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    times = interleaved_decode_steps(llms, work.prompts, params, steps)
    return {name: batch / statistics.median(t) for name, t in times.items()}


def decode_rate(llm: LLM, batch: int, input_len: int, steps: int) -> float:
    return decode_rates({"": llm}, batch, input_len, steps)[""]


def _fidelity_row(r: QuantizeResult) -> dict:
    f = r.fidelity
    row = {"kl_mean": f.kl_mean, "kl_p99": f.kl_p99, "top1_agreement": f.top1_agreement,
           "ppl_change": f.ppl_change, "quantized_params": r.quantized_params,
           "tool_json_full": r.tool_json.get("full"), "tool_json_quant": r.tool_json.get("quant")}
    if r.naive and r.searched:
        row.update(naive_params=r.naive.params, naive_kl=r.naive.fidelity.kl_mean if r.naive.fidelity else None,
                   searched_params=r.searched.params, searched_kl=r.searched.fidelity.kl_mean if r.searched.fidelity else None,
                   searched_vs_naive_params=r.searched.params / max(r.naive.params, 1),
                   evaluations=r.searched.evaluations)
    return row


def _source_row(f: Fidelity, f32: Fidelity | None = None) -> dict:
    """The fidelity of a scheme that rounds no weight of its own (kv-int8, gguf, the baseline beside gguf)."""
    return {"kl_mean": f.kl_mean, "kl_p99": f.kl_p99, "top1_agreement": f.top1_agreement,
            "ppl_change": f.ppl_change, **(_fp32_row(f32) if f32 else {})}


def _fp32_row(f: Fidelity) -> dict:
    """The weights' (or the KV cache's) rounding alone: both models computed in float32."""
    return {"kl_mean_fp32": f.kl_mean, "kl_p99_fp32": f.kl_p99, "top1_agreement_fp32": f.top1_agreement}


def _openvino_fidelity(args: argparse.Namespace, ref: Reference) -> dict[str, dict]:
    """OpenVINO's own model in each asked-for format against `ref` (the fp32 model) on ref's text: the fidelity
    its int8 and int4 weights, and its own rounding of activations, give up (--dynamic-quant is held to it)."""
    if not args.openvino_formats:
        return {}
    rows = {}  # export() says how to install the peer where it is missing
    for fmt, path in openvino_peer.export(args.model, openvino_peer.parse_formats(args.openvino_formats, None)).items():
        logits, precision = openvino_peer.logits(path, ref.meter.sequences, torch.get_num_threads())
        rows[fmt] = {**_source_row(ref.meter.measure_logits(logits)), "inference_precision": precision, "ir": str(path)}
        print(f"openvino-{fmt}: {json.dumps(rows[fmt])}", file=sys.stderr)
    return rows


def run_quant_bench(args: argparse.Namespace) -> int:
    schemes = [s.strip() for s in args.schemes.split(",") if s.strip()]
    batches = [int(b) for b in args.batch_sizes.split(",")]
    model_path = resolve_model(args.model)
    out_root = Path(args.out_dir or tempfile.mkdtemp(prefix="kvyard-quant-"))
    fidelity: dict[str, dict] = {}
    dynamic: set[str] = set()  # the --dynamic-quant twins of the low-bit schemes
    base = str(parse_dtype(args.dtype)).removeprefix("torch.")  # the unquantized model, e.g. bfloat16
    paths: dict[str, str] = {base: str(model_path)}
    protect = DEFAULT_PROTECT if args.protect is None else tuple(p for p in args.protect.split(",") if p)
    kv_dtypes = {base: "auto"}
    measure_dtype = args.fidelity_dtype or args.dtype
    fp32_source = load_reference(QuantizeOptions(model=str(model_path), scheme="int8", dtype="float32"))
    for scheme in schemes:
        t0 = time.perf_counter()
        kv_dtypes[scheme] = "int8" if scheme == KV_INT8 else "auto"
        paths[scheme] = str(model_path)  # kv-int8 and gguf round no weight: they run the source itself
        if scheme == KV_INT8:  # dense weights, int8 KV cache
            f = kv_cache_fidelity(load_reference(QuantizeOptions(model=str(model_path), scheme="int8", dtype=measure_dtype)))
            fidelity[scheme] = _source_row(f, kv_cache_fidelity(fp32_source))
        elif scheme == KEEP_GGUF:  # the file's blocks kept; it and the plain load (the baseline) against the file
            if measure_dtype != "float32":  # (in float32 the plain load is the reference itself)
                fidelity[base] = _source_row(source_fidelity(fp32_source, measure_dtype, keep_blocks=False))
            fidelity[scheme] = _source_row(source_fidelity(fp32_source, measure_dtype, keep_blocks=True),
                                           source_fidelity(fp32_source, "float32", keep_blocks=True))
        else:
            r = quantize_model(QuantizeOptions(model=str(model_path), scheme=scheme, out=out_root / scheme,
                                               kl_budget=args.kl_budget, mixed_weight=args.mixed_weight,
                                               dtype=measure_dtype, sensitivity=scheme == "mixed", protect=protect,
                                               rounding=args.rounding, scaling=args.scaling,
                                               outlier_columns=args.outlier_columns, head_scheme=args.head_scheme))
            f32 = saved_fidelity(fp32_source, out_root / scheme)
            fidelity[scheme] = {**_fidelity_row(r), **_fp32_row(f32), "quantize_s": time.perf_counter() - t0}
            paths[scheme] = str(out_root / scheme)
        print(f"{scheme}: {json.dumps(fidelity[scheme])}", file=sys.stderr)
        if args.dynamic_quant and scheme != KV_INT8:
            twin = f"{scheme}{DYNAMIC_SUFFIX}"
            dynamic.add(twin)
            paths[twin], kv_dtypes[twin] = paths[scheme], "auto"
            f = (served_fidelity(fp32_source, measure_dtype, KEEP_GGUF, False, dynamic_quant=True)
                 if scheme == KEEP_GGUF else
                 saved_fidelity(fp32_source, paths[scheme], dynamic_quant=True, dtype=measure_dtype))
            fidelity[twin] = _source_row(f)
            print(f"{twin}: {json.dumps(fidelity[twin])}", file=sys.stderr)
    openvino = _openvino_fidelity(args, fp32_source)
    del fp32_source  # float32 weights and their model: more memory than the timed engines (Qwen2.5-Coder-1.5B)
    gc.collect()
    engines = {name: LLM(config=EngineConfig(model=p, dtype=args.dtype, kv_cache_memory="1GiB",
                                             kv_cache_dtype=kv_dtypes[name], dynamic_quant=name in dynamic,
                                             quantization=KEEP_GGUF if name.removesuffix(DYNAMIC_SUFFIX) == KEEP_GGUF
                                             else None))
               for name, p in paths.items()}
    rounds = []
    for r in range(args.repeats):
        row = {f"{name}.b{b}": rate for b in batches
               for name, rate in decode_rates(engines, b, args.input_len, args.decode_steps).items()}
        print(f"round {r + 1}: " + ", ".join(f"{k}={v:.1f}" for k, v in row.items()), file=sys.stderr)
        rounds.append(row)
    med = {k: statistics.median(rd[k] for rd in rounds) for k in rounds[0]}
    table = {}
    for name, llm in engines.items():
        entry = {"weight_bytes": weight_bytes(llm), "kv_bytes_per_token": kv_bytes_per_token(llm),
                 **fidelity.get(name, {})}
        for b in batches:
            entry[f"decode_tok_s_b{b}"] = med[f"{name}.b{b}"]
            if name != base:
                entry[f"speedup_b{b}"] = med[f"{name}.b{b}"] / med[f"{base}.b{b}"]
                entry[f"speedup_b{b}_per_round"] = [round(rd[f"{name}.b{b}"] / rd[f"{base}.b{b}"], 3) for rd in rounds]
            if name in dynamic:  # against the same weights without int8 activations
                plain = name.removesuffix(DYNAMIC_SUFFIX)
                entry[f"dynamic_quant_speedup_b{b}"] = med[f"{name}.b{b}"] / med[f"{plain}.b{b}"]
        table[name] = entry
    result = {
        "model": model_path.name, "dtype": args.dtype, "fidelity_dtype": measure_dtype, "rounding": args.rounding,
        "scaling": args.scaling, "outlier_columns": args.outlier_columns,
        "head_scheme": args.head_scheme, "baseline": base, "machine": machine_info(),
        "workload": {"input_len": args.input_len, "decode_steps": args.decode_steps, "batch_sizes": batches,
                     "repeats": args.repeats},
        "schemes": table, "openvino": openvino, "rounds": rounds, "checkpoints": str(out_root),
    }
    emit_json(result, args.json_out)
    return 0
