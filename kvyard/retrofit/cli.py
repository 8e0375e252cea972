"""`kvyard retrofit`: the command line of kvyard/retrofit/tool.py."""

import argparse
import json

from kvyard.retrofit.distill import DistillSettings
from kvyard.retrofit.tool import RetrofitSettings, retrofit


def add_retrofit_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("retrofit", help="convert a model's attention to a cheaper kind (fewer KV heads, a sliding window), report "
                                        "what it costs against the original")
    p.add_argument("--model", default="smollm2-135m", help="a model name, HF directory or .gguf file")
    p.add_argument("--out", required=True, help="the converted checkpoint's directory (kvyard serve --model DIR)")
    p.add_argument("--attention", choices=("mqa", "swa"), default="mqa",
                   help="mqa: mean-pool each group of KV heads into one; swa: sliding-window attention on --layers")
    p.add_argument("--kv-heads", type=int, default=1, help="mqa: the KV heads to keep (they divide the model's)")
    p.add_argument("--window", type=int, default=128, help="swa: the window, in positions")
    p.add_argument("--sinks", type=int, default=0,
                   help="swa: the first positions the sliding layers also see (attention sinks; their KV is kept)")
    p.add_argument("--layers", default="all", help="swa: the layers that slide: all, or indices and ranges (2-27,29)")
    p.add_argument("--kv-context", type=int, default=2048,
                   help="KV bytes are counted for a sequence this long (a sliding layer holds only its window)")
    p.add_argument("--dtype", default="bfloat16", help="the serving dtype (KV bytes; the original's answers)")
    p.add_argument("--eval-prompts", type=int, default=16, help="held-out prompts for the KL and top-1 agreement")
    p.add_argument("--distill-prompts", type=int, default=256,
                   help="chat prompts the original answers for the distillation back toward it (0: none)")
    p.add_argument("--distill-tokens", type=int, default=96, help="the original's answer length")
    p.add_argument("--distill-minutes", type=float, default=30.0, help="the distillation's time budget")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--train", choices=("kv", "attention"), default="kv",
                   help="the projections that train: k and v, or the whole attention (q, k, v, o)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_retrofit)


def cmd_retrofit(args: argparse.Namespace) -> int:
    distill = DistillSettings(minutes=args.distill_minutes, epochs=args.epochs, lr=args.lr, train=args.train,
                              progress=not args.no_progress)
    report = retrofit(RetrofitSettings(model=args.model, out=args.out, attention=args.attention,
                                       kv_heads=args.kv_heads, window=args.window, sinks=args.sinks, layers=args.layers,
                                       kv_context=args.kv_context, eval_prompts=args.eval_prompts, dtype=args.dtype,
                                       distill_prompts=args.distill_prompts, distill_tokens=args.distill_tokens,
                                       distill=distill))
    print(json.dumps(report, indent=2))
    return 0
