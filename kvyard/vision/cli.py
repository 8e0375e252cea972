"""`kvyard graft vision`: the command line of kvyard/vision/graft.py."""

import argparse
import json

from kvyard.vision.graft import GraftSettings, train_graft


def add_graft_parser(sub: argparse._SubParsersAction) -> None:
    graft = sub.add_parser("graft", help="join a frozen encoder to a frozen model").add_subparsers(
        dest="graft", required=True)
    p = graft.add_parser("vision", help="train a projector from EfficientNet-Lite0 to a language model on easy-VQA")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--encoder", default="efficientnet-lite0", help="the encoder's weights (a name or a .pth)")
    p.add_argument("--out", required=True, help="the graft's directory")
    p.add_argument("--tokens", type=int, default=4, help="soft tokens per image")
    p.add_argument("--width", type=int, default=1024, help="the projector's hidden layer")
    p.add_argument("--train-questions", type=int, default=8000)
    p.add_argument("--eval-questions", type=int, default=600)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_graft_vision)


def cmd_graft_vision(args: argparse.Namespace) -> int:
    report = train_graft(GraftSettings(
        out=args.out, model=args.model, encoder=args.encoder, tokens=args.tokens, width=args.width,
        train_questions=args.train_questions, eval_questions=args.eval_questions, epochs=args.epochs,
        batch=args.batch, lr=args.lr, seed=args.seed, progress=not args.no_progress))
    print(json.dumps({k: report[k] for k in ("least_squares_relative_error", "steps", "first_loss", "last_loss",
                                             "accuracy", "seconds")}, indent=2))
    return 0
