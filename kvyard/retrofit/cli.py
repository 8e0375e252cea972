"""`kvyard retrofit`: the command line of kvyard/retrofit/tool.py."""

import argparse
import json

from kvyard.retrofit.tool import RetrofitSettings, retrofit


def add_retrofit_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("retrofit", help="convert a model's attention to a cheaper kind (fewer KV heads), report "
                                        "what it costs against the original")
    p.add_argument("--model", default="smollm2-135m", help="a model name, HF directory or .gguf file")
    p.add_argument("--out", required=True, help="the converted checkpoint's directory (kvyard serve --model DIR)")
    p.add_argument("--attention", choices=("mqa",), default="mqa",
                   help="mqa: mean-pool each group of KV heads into one")
    p.add_argument("--kv-heads", type=int, default=1, help="mqa: the KV heads to keep (they divide the model's)")
    p.add_argument("--eval-prompts", type=int, default=16, help="held-out prompts for the KL and top-1 agreement")
    p.set_defaults(func=cmd_retrofit)


def cmd_retrofit(args: argparse.Namespace) -> int:
    report = retrofit(RetrofitSettings(model=args.model, out=args.out, attention=args.attention,
                                       kv_heads=args.kv_heads, eval_prompts=args.eval_prompts))
    print(json.dumps(report, indent=2))
    return 0
