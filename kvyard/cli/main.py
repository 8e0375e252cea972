"""`kvyard` command line: generate, serve, route, up, quantize, moe, fetch, bench."""

import argparse
import sys

from kvyard.cli.engine_args import add_engine_args, engine_config_from_args
from kvyard.errors import KvyardError


def cmd_generate(args: argparse.Namespace) -> int:
    from kvyard.llm import LLM
    from kvyard.sampling_params import SamplingParams

    llm = LLM(config=engine_config_from_args(args))
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed,
        repetition_penalty=args.repetition_penalty,
    )
    use_chat = not args.raw and llm.tokenizer.chat_template is not None
    prompt = llm.chat_prompt([{"role": "user", "content": args.prompt}]) if use_chat else args.prompt
    for out in llm.stream(prompt, params):
        sys.stdout.write(out.outputs[0].delta_text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    done = out.outputs[0]
    print(f"[{len(done.token_ids)} tokens, finish_reason={done.finish_reason}]", file=sys.stderr)
    return 0


def cmd_fetch(args: argparse.Namespace) -> int:
    from kvyard.loader.registry import resolve_model

    print(resolve_model(args.name))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvyard", description="kvyard LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a completion for one prompt, streamed to stdout")
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.7)
    gen.add_argument("--top-p", type=float, default=0.95)
    gen.add_argument("--repetition-penalty", type=float, default=1.1)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    from kvyard.cli.route import add_route_parsers
    from kvyard.cli.serve import add_serve_parser
    from kvyard.quant.cli import add_quantize_parser
    from kvyard.spec.speculator.cli import add_speculator_parser

    add_serve_parser(sub)
    add_route_parsers(sub)
    add_quantize_parser(sub)
    add_speculator_parser(sub)

    from kvyard.models.moe_split import add_moe_parser

    add_moe_parser(sub)

    from kvyard.lora.cli import add_lora_parser
    from kvyard.plan.cli import add_plan_parser
    from kvyard.plan.tune_cli import add_tune_parser
    from kvyard.retrofit.cli import add_retrofit_parser
    from kvyard.shadow.report import add_shadow_parser
    from kvyard.vision.cli import add_graft_parser

    add_shadow_parser(sub)
    add_lora_parser(sub)
    add_retrofit_parser(sub)
    add_graft_parser(sub)
    add_plan_parser(sub)
    add_tune_parser(sub)

    fetch = sub.add_parser("fetch", help="download and verify a known model, print its path")
    fetch.add_argument("name", nargs="?", default="smollm2-135m")
    fetch.set_defaults(func=cmd_fetch)

    from kvyard.bench.disagg import add_disagg_bench_parser
    from kvyard.bench.graft import add_graft_bench_parser
    from kvyard.bench.kv_transfer import add_kv_transfer_bench_parser
    from kvyard.bench.lora import add_lora_bench_parser
    from kvyard.bench.lora_loop import add_lora_loop_bench_parser
    from kvyard.bench.offline import add_offline_bench_parser
    from kvyard.bench.offload import add_offload_bench_parser
    from kvyard.bench.plan import add_plan_bench_parser
    from kvyard.bench.prefix import add_prefix_bench_parser
    from kvyard.bench.quant import add_quant_bench_parser
    from kvyard.bench.ray_route import add_ray_bench_parser
    from kvyard.bench.route import add_route_bench_parser
    from kvyard.bench.serve import add_serve_bench_parsers
    from kvyard.bench.spec import add_spec_bench_parser
    from kvyard.bench.step_profile import add_step_profile_parser
    from kvyard.bench.structured import add_structured_bench_parser

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    add_offline_bench_parser(bench)
    add_serve_bench_parsers(bench)
    add_prefix_bench_parser(bench)
    add_route_bench_parser(bench)
    add_ray_bench_parser(bench)
    add_quant_bench_parser(bench)
    add_structured_bench_parser(bench)
    add_spec_bench_parser(bench)
    add_disagg_bench_parser(bench)
    add_kv_transfer_bench_parser(bench)
    add_offload_bench_parser(bench)
    add_step_profile_parser(bench)
    add_plan_bench_parser(bench)
    add_lora_bench_parser(bench)
    add_lora_loop_bench_parser(bench)
    add_graft_bench_parser(bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KvyardError as e:
        print(f"kvyard: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
