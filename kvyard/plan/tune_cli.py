"""`kvyard tune`: sweep a deployment's knobs against a workload and its SLOs; write the best as a deployment file.

    kvyard tune --model smollm2-135m --workload chat-tools --slo-ttft-ms 1000 --slo-tpot-ms 100 \\
        --knob engine.max_num_seqs=8,32 --knob engine.quantization=int8 --out tune-results
    kvyard serve --config tune-results/deploy.yaml
"""

import argparse
import logging
import sys
from pathlib import Path

from kvyard.bench.serve import add_slo_args, add_workload_args, workload_from_args
from kvyard.bench.serve_metrics import SLOs
from kvyard.bench.serve_run import BenchError
from kvyard.errors import ConfigError
from kvyard.plan.goodput import GoodputSearch
from kvyard.plan.tune import TuneOptions, Tuner, best_row
from kvyard.plan.tune_report import markdown, plot, write_deployment
from kvyard.plan.tune_space import candidates, load_base, parse_knob, read_space
from kvyard.shadow.compare import Budgets


def options_from_args(args: argparse.Namespace) -> tuple[TuneOptions, list]:  # type: ignore[type-arg]
    slos = SLOs(args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2e_ms)
    if not slos.given():
        raise ConfigError("give at least one SLO (--slo-ttft-ms, --slo-tpot-ms, --slo-e2e-ms): goodput is the load "
                          "that meets them", param="slo")
    space = read_space(args.space) if args.space else {}
    for text in args.knob:
        name, values = parse_knob(text)
        space[name] = values
    cands = candidates(load_base(args.base, args.model), space)
    search = GoodputSearch(url="", workload=workload_from_args(args), slos=slos, attain=args.attain,
                           start_rate=args.start_rate, max_probes=args.max_probes, resolution=args.resolution,
                           trace=args.trace, tokenizer=args.tokenizer, timeout=args.request_timeout)
    opts = TuneOptions(out=Path(args.out), search=search, repeats=args.repeats, port=args.port,
                       ready_timeout=args.ready_timeout, kl_budget=args.kl_budget)
    return opts, cands


def run_tune(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per probe request
    try:
        opts, cands = options_from_args(args)
    except (ConfigError, BenchError) as e:
        print(f"kvyard tune: error: {e}", file=sys.stderr)
        return 2
    rows = Tuner(opts, cands).run()
    best = best_row(rows)
    report = markdown(rows, best, opts.search.trace or opts.search.workload.name)
    (opts.out / "tune.md").write_text(report)
    plot(rows, opts.out / "pareto.png")
    print(report)
    if best is None:
        return 1
    write_deployment(best, opts.out / "deploy.yaml")
    how = "kvyard up" if best["settings"].get("cluster") else "kvyard serve"
    print(f"run it: {how} --config {opts.out / 'deploy.yaml'}")
    return 0


def add_tune_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tune", help="sweep deployment knobs for the highest goodput under SLOs (#38)")
    p.add_argument("--model", default=None, help="the model to deploy (default: the base file's, else kvyard's)")
    p.add_argument("--base", default=None,
                   help="the default deployment file: every candidate starts from it and is compared with it")
    p.add_argument("--space", default=None, help="YAML of section: {field: [values]} to sweep")
    p.add_argument("--knob", action="append", default=[], metavar="SECTION.FIELD=V1,V2",
                   help="a knob to sweep, e.g. engine.max_num_seqs=8,32 (repeatable; adds to --space)")
    p.add_argument("--out", default="tune-results", help="results.jsonl (resumable), tune.md, pareto.png, deploy.yaml")
    p.add_argument("--repeats", type=int, default=2, help="goodput searches per candidate, each on a fresh start")
    p.add_argument("--attain", type=float, default=0.9, help="share of requests that must meet the SLOs")
    p.add_argument("--start-rate", type=float, default=1.0, help="requests/s of the first probe")
    p.add_argument("--max-probes", type=int, default=8, help="probes per goodput search")
    p.add_argument("--resolution", type=float, default=0.15, help="stop once pass and fail are this close")
    p.add_argument("--kl-budget", type=float, default=Budgets().kl_mean,
                   help="mean KL per token a candidate that changes numerics may reach")
    p.add_argument("--port", type=int, default=8790, help="where each candidate listens (loopback)")
    p.add_argument("--ready-timeout", type=float, default=300.0, help="seconds a candidate may take to start")
    p.add_argument("--request-timeout", type=float, default=120.0, help="seconds one request may take")
    add_workload_args(p, loads=False)
    add_slo_args(p.add_argument_group("SLOs"))
    p.set_defaults(func=run_tune)
