"""`kvyard speculator train --target MODEL --prompts FILE --out DIR`."""

import argparse
import json
import sys

import torch

from kvyard.spec.speculator.config import TrainConfig

DEFAULTS = TrainConfig(target="", prompts="", out="")

def add_speculator_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("speculator", help="trained speculators for speculative decoding")
    cmds = p.add_subparsers(dest="speculator_command", required=True)
    t = cmds.add_parser("train", help="distil a target's outputs on a workload into a small drafter")
    t.add_argument("--target", default="smollm2-135m", help="the model to draft for (name, HF directory, .gguf)")
    t.add_argument("--prompts", required=True,
                   help="workload: .jsonl ({'prompt'} or {'messages'} per line) or text, one prompt per line")
    t.add_argument("--out", required=True, help="directory for speculator.json and model.safetensors")
    t.add_argument("--init-layers", default=",".join(map(str, DEFAULTS.init_layers)),
                   help="target layers the drafter's layers start from (their count is its depth; -1 = last)")
    t.add_argument("--draft-vocab", type=int, default=DEFAULTS.draft_vocab,
                   help="tokens the drafter may propose: the target's most frequent outputs (0 = all)")
    t.add_argument("--loss", choices=("hard", "soft"), default=DEFAULTS.loss,
                   help="fit the target's argmax (hard) or its top-20 distribution (soft)")
    t.add_argument("--prompt-lookup", action=argparse.BooleanOptionalAction, default=DEFAULTS.prompt_lookup,
                   help="draft by prompt lookup where the context repeats itself, by the model elsewhere")
    t.add_argument("--max-tokens", type=int, default=DEFAULTS.max_tokens, help="tokens generated per prompt")
    t.add_argument("--num-prompts", type=int, default=None, help="use the file's first N prompts")
    t.add_argument("--temperature", type=float, default=DEFAULTS.temperature, help="of the data generation (0: greedy)")
    t.add_argument("--epochs", type=int, default=DEFAULTS.epochs)
    t.add_argument("--lr", type=float, default=DEFAULTS.lr)
    t.add_argument("--batch-tokens", type=int, default=DEFAULTS.batch_tokens, help="padded tokens per training batch")
    t.add_argument("--holdout", type=float, default=DEFAULTS.holdout, help="share of samples kept for the acceptance estimate")
    t.add_argument("--seed", type=int, default=DEFAULTS.seed)
    t.add_argument("--dtype", default=DEFAULTS.dtype, help="of the engine that generates the data")
    t.add_argument("--data-cache", default=None,
                   help="file for the generated samples: reused if it exists (retrain without regenerating)")
    t.add_argument("--num-threads", type=int, default=None)
    t.set_defaults(func=cmd_train)


def cmd_train(args: argparse.Namespace) -> int:
    from kvyard.spec.speculator.train import train_speculator

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    cfg = TrainConfig(
        target=args.target, prompts=args.prompts, out=args.out,
        init_layers=[int(i) for i in args.init_layers.split(",")], draft_vocab=args.draft_vocab, loss=args.loss,
        max_tokens=args.max_tokens, num_prompts=args.num_prompts, temperature=args.temperature, epochs=args.epochs,
        lr=args.lr, batch_tokens=args.batch_tokens, holdout=args.holdout, seed=args.seed, dtype=args.dtype,
        data_cache=args.data_cache, prompt_lookup=args.prompt_lookup,
    )
    summary = train_speculator(cfg)
    print(json.dumps(summary, indent=2))
    print(f"saved to {args.out}; use it with --speculator {args.out}", file=sys.stderr)
    return 0
