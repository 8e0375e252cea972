"""`kvyard lora train` and `kvyard lora promote`: the command lines of kvyard/lora/train.py and promote.py."""

import argparse
import json
from pathlib import Path

from kvyard.lora.data import KEEP
from kvyard.lora.promote import Bar, PromoteSettings, print_report, promote
from kvyard.lora.train import DEFAULT_TARGETS, TrainSettings, train_adapter


def add_lora_parser(sub: argparse._SubParsersAction) -> None:
    lora = sub.add_parser("lora", help="LoRA adapters").add_subparsers(dest="lora", required=True)
    p = lora.add_parser("train", help="fit a LoRA adapter to captured traffic or a chat file (PEFT format out)")
    p.add_argument("--model", default="smollm2-135m", help="the base: a model name, HF directory or .gguf file")
    p.add_argument("--data", required=True,
                   help="JSON lines: capture records (kvyard serve --capture-dir), {'messages'} chats ending with "
                        "the assistant's turn, or {'prompt', 'completion'}")
    p.add_argument("--out", required=True, help="the adapter's directory")
    p.add_argument("--objective", choices=("sft", "distill"), default="sft",
                   help="sft: learn the file's completions; distill: learn the teacher's answers to its prompts")
    p.add_argument("--teacher", help="distill: the teacher model (default: the base, reading the prompts whole)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="distill: the teacher's answer length")
    p.add_argument("--drop", action="append", default=[], metavar="TEXT",
                   help="remove this text from the student's prompts (repeatable): a system prompt or an "
                        "instruction whose behaviour the adapter should learn")
    p.add_argument("--keep", choices=sorted(KEEP), default="all", help="train only on these completions")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--alpha", type=float, default=16.0)
    p.add_argument("--targets", default=",".join(DEFAULT_TARGETS), help="comma-separated module names")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch-tokens", type=int, default=512, help="padded tokens per optimizer step")
    p.add_argument("--held-out", type=float, default=0.1, help="the share of examples kept out for evaluation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bf16", action="store_true", help="bfloat16 autocast (faster with AMX or AVX512-BF16)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_train)

    q = lora.add_parser("promote", help="shadow an adapter against a served name on live traffic; promote it to "
                                        "that name only if the stated bars hold (exit 1 if not)")
    q.add_argument("--router", required=True, help="the router's URL (its workers take run-time adapter updates)")
    q.add_argument("--name", required=True, help="the served name the adapter becomes")
    q.add_argument("--adapter", required=True, help="the adapter's directory, readable by every worker")
    q.add_argument("--bar", action="append", required=True, type=Bar.parse, metavar="METRIC>=VALUE",
                   help="a condition on the shadow verdict (repeatable): json_valid_candidate, json_gain, "
                        "exact_match, kl_mean, ttft_delta_s, ...")
    q.add_argument("--primary", help="the model whose live requests are mirrored (default: --name)")
    q.add_argument("--pairs", type=int, default=32, help="compared requests before the verdict")
    q.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for them")
    q.add_argument("--json-out")
    q.set_defaults(func=cmd_promote)


def cmd_promote(args: argparse.Namespace) -> int:
    report = promote(PromoteSettings(router=args.router, name=args.name, adapter=args.adapter, bars=args.bar,
                                     primary=args.primary, pairs=args.pairs, timeout_s=args.timeout))
    print_report(report)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")
    return 0 if report["promoted"] else 1


def cmd_train(args: argparse.Namespace) -> int:
    report = train_adapter(TrainSettings(
        model=args.model, data=args.data, out=args.out, objective=args.objective, teacher=args.teacher,
        max_new_tokens=args.max_new_tokens, drop=args.drop, keep=args.keep, rank=args.rank, alpha=args.alpha,
        targets=[t.strip() for t in args.targets.split(",") if t.strip()], epochs=args.epochs, lr=args.lr,
        batch_tokens=args.batch_tokens, held_out=args.held_out, seed=args.seed, bf16=args.bf16,
        progress=not args.no_progress))
    print(json.dumps({k: report[k] for k in ("examples", "steps", "first_loss", "last_loss", "held_out_before",
                                             "held_out_after", "seconds")}, indent=2))
    print(f"adapter written to {args.out} (serve it with --lora NAME={args.out})")
    return 0
