"""`kvyard quantize --model M --scheme int4-g128|int8|mixed --calib FILE --kl-budget X --out DIR`."""

import argparse
from pathlib import Path

from kvyard.quant.awq import DEFAULT_SCALING, SCALINGS
from kvyard.quant.plan import DEFAULT_PROTECT
from kvyard.quant.scheme import DEFAULT_ROUNDING, ROUNDINGS, SCHEME_HELP


def cmd_quantize(args: argparse.Namespace) -> int:
    from kvyard.quant.report import write_report
    from kvyard.quant.tool import QuantizeOptions, quantize_model

    protect = tuple(p for p in args.protect.split(",") if p) if args.protect is not None else DEFAULT_PROTECT
    opts = QuantizeOptions(
        model=args.model, scheme=args.scheme, out=Path(args.out), calib=args.calib, kl_budget=args.kl_budget,
        protect=protect, mixed_weight=args.mixed_weight, dtype=args.dtype, max_seq_len=args.max_seq_len,
        sensitivity=not args.no_sensitivity, tool_eval=not args.no_tool_eval, rounding=args.rounding,
        scaling=args.scaling, outlier_columns=args.outlier_columns, head_scheme=args.head_scheme,
    )
    result = quantize_model(opts)
    paths = write_report(result, Path(args.out))
    print(paths[0].read_text())
    print(f"wrote {args.out} (serve it with: kvyard serve --model {args.out})")
    if args.kl_budget is not None and result.fidelity.kl_mean > args.kl_budget:
        print(f"note: mean KL {result.fidelity.kl_mean:.3g} is above --kl-budget {args.kl_budget:g}")
    return 0


def add_head_scheme_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--head-scheme", default=None,
                   help="quantize the LM head too, in this format (e.g. int8 beside int4-g128 layers); "
                   "by default it follows --protect, which keeps it dense")


def add_quantize_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("quantize", help="quantize a model's weights and report its fidelity (KL vs full precision)")
    p.add_argument("--model", default="smollm2-135m", help="model name, HF directory or .gguf file")
    p.add_argument("--scheme", required=True, help=SCHEME_HELP)
    p.add_argument("--out", required=True, help="output directory (loadable by kvyard serve --model DIR)")
    p.add_argument("--calib", default=None, help="calibration text (.txt paragraphs or .jsonl with text/prompt); "
                   "tool-call JSON prompts are always added")
    p.add_argument("--kl-budget", type=float, default=None, help="largest mean KL per token (required for mixed)")
    p.add_argument("--protect", default=None,
                   help=f"comma-separated layer names or re: patterns kept dense (default: {','.join(DEFAULT_PROTECT)}; "
                   "pass '' to protect nothing)")
    p.add_argument("--mixed-weight", default="int4-g128", help="low-bit format of the layers a mixed plan picks")
    p.add_argument("--dtype", default="bfloat16", help="compute dtype while measuring fidelity")
    p.add_argument("--max-seq-len", type=int, default=256, help="tokens per calibration sequence")
    p.add_argument("--rounding", choices=ROUNDINGS, default=DEFAULT_ROUNDING,
                   help="rtn (default): round to nearest; gptq: GPTQ with Hessians from the calibration set "
                   "(the KL then reported is in-sample)")
    p.add_argument("--scaling", choices=SCALINGS, default=DEFAULT_SCALING,
                   help="awq: scale each layer's input channels by their activation size before rounding, "
                   "folded into the op before it; none: plain rounding; auto (default): both, keep the lower KL")
    p.add_argument("--outlier-columns", type=float, default=0.0,
                   help="share of each layer's input columns (those with the largest activations on the calibration "
                   "set) kept in full precision beside the low-bit codes, as LLM.int8() does; e.g. 0.02")
    add_head_scheme_arg(p)
    p.add_argument("--no-sensitivity", action="store_true", help="skip the per-layer sensitivity pass (not for mixed)")
    p.add_argument("--no-tool-eval", action="store_true", help="skip the tool-call JSON generation check")
    p.set_defaults(func=cmd_quantize)
