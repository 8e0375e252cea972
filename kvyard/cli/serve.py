"""`kvyard serve`: the OpenAI-compatible server, configured by flags over an optional YAML file.

Precedence, lowest first: dataclass defaults, the `--config` file, `KVYARD_API_KEY` (for the key only,
so it need not appear in `ps`), flags given on the command line. To tell a given flag from a default,
every flag of this subcommand defaults to None, and only non-None values override the file.
"""

import argparse
import dataclasses
import logging
import os
from typing import TYPE_CHECKING

from kvyard.cli.engine_args import add_engine_args
from kvyard.config import EngineConfig

if TYPE_CHECKING:
    from kvyard.server.config import DeployConfig, ServerSettings

_SERVER_FLAGS: list[tuple[str, type, str]] = [
    ("host", str, "address to listen on (default 127.0.0.1; 0.0.0.0 for all interfaces)"),
    ("port", int, "port to listen on (default 8000)"),
    ("api_key", str, "require `Authorization: Bearer KEY` on every route but /health "
                     "(default: $KVYARD_API_KEY, else no auth)"),
    ("max_queue", int, "refuse requests with 429 while this many are queued (default 256)"),
    ("max_body_bytes", str, "largest request body, e.g. 1MiB (default); larger ones get 413"),
    ("request_timeout", float, "seconds a request may take in all (default 600)"),
    ("drain_timeout", float, "seconds in-flight requests get to finish after SIGTERM (default 30)"),
    ("served_model_name", str, "the model name clients use (default: --model)"),
    ("log_level", str, "uvicorn and kvyard log level (default info)"),
    ("repetition_guard", str, "when a generation loops: stop (default: finish_reason \"repetition\"), retry or off; "
                              "detection settings come from --config's server.repetition_guard"),
    ("generation_config", str, "sampling defaults for what a request leaves out: auto (default: the model's "
                               "generation_config.json or GGUF metadata) or none (kvyard's own)"),
    ("json_whitespace", str, "whitespace in constrained JSON: compact (default: one line, \", \" and \": \") or any "
                             "(what JSON allows, at most 4 characters per gap)"),
    ("kv_events_port", int, "publish KV cache events for `kvyard route` on this ZeroMQ port (0: any free port)"),
    ("role", str, "prefill/decode disaggregation: both (default), prefill or decode"),
    ("kv_transfer_port", int, "prefill role: ZeroMQ port decode workers pull KV from (default: any free port)"),
    ("kv_transfer_mode", str, "KV transfer framing over TCP: layers (default: one message per layer, pipelined) "
                              "or blocks (one message)"),
    ("kv_hold_timeout", float, "prefill role: seconds to keep KV that no decode worker pulled (default 30)"),
    ("capture", str, "capture requests as JSON lines into this directory (sampling, redaction and size budgets "
                     "from --config's server.capture)"),
    ("kv_fetch_timeout", float, "decode role: seconds to wait for a KV pull before prefilling locally (default 10)"),
    ("enable_lora_runtime_updates", bool, "allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter"),
]


def add_serve_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API (completions, chat, metrics)")
    p.add_argument("--config", default=None,
                   help="YAML deployment file with `engine:` and `server:` sections; flags override it")
    g = p.add_argument_group("server")
    for name, kind, help_text in _SERVER_FLAGS:
        if kind is bool:  # a switch; left out, the deployment file's value (or the default) stands
            g.add_argument("--" + name.replace("_", "-"), action="store_const", const=True, default=None, help=help_text)
        else:
            g.add_argument("--" + name.replace("_", "-"), type=kind, default=None, help=help_text)
    add_engine_args(p)
    p.set_defaults(**{f.name: None for f in dataclasses.fields(EngineConfig)}, func=cmd_serve)


def explicit_values(args: argparse.Namespace, names: list[str]) -> dict[str, object]:
    return {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}


def configs_from_args(
    args: argparse.Namespace, deploy: "DeployConfig | None" = None
) -> "tuple[EngineConfig, ServerSettings]":
    """`deploy`: the deployment file's sections when they came some other way than `--config` (a Ray actor's)."""
    from kvyard.cluster.auth import TOKEN_ENV
    from kvyard.server.config import build_configs, load_deploy_config

    deploy = load_deploy_config(args.config) if args.config else deploy
    engine_flags = explicit_values(args, [f.name for f in dataclasses.fields(EngineConfig)])
    server_flags = explicit_values(args, [name for name, _, _ in _SERVER_FLAGS])
    if "api_key" not in server_flags and os.environ.get("KVYARD_API_KEY"):
        server_flags["api_key"] = os.environ["KVYARD_API_KEY"]
    if os.environ.get(TOKEN_ENV):  # only ever from the environment (`kvyard up` sets it), never a flag
        server_flags["cluster_token"] = os.environ[TOKEN_ENV]
    return build_configs(deploy, engine_flags, server_flags)


def cmd_serve(args: argparse.Namespace) -> int:
    engine_config, settings = configs_from_args(args)
    logging.basicConfig(level=settings.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")

    from kvyard.server.lifecycle import serve

    serve(engine_config, settings)
    return 0
