"""`kvyard route` (the cache-aware router in front of running workers) and `kvyard up` (workers + router)."""

import argparse
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvyard.errors import ConfigError
from kvyard.loader.registry import DEFAULT_MODEL
from kvyard.router.config import POLICIES
from kvyard.server.config import DeployConfig, load_deploy_config

if TYPE_CHECKING:
    from kvyard.cluster.config import ClusterConfig

# RouterSettings fields that are flags of both commands: (name, type, help)
def shadow_arg(value: str) -> str | dict[str, Any]:
    """--shadow: a URL, or a JSON object of the shadow settings."""
    if not value.lstrip().startswith("{"):
        return value
    try:
        settings = json.loads(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not a JSON object: {e}") from e
    if not isinstance(settings, dict):
        raise argparse.ArgumentTypeError("not a JSON object")
    return settings


_ROUTER_FLAGS: list[tuple[str, Any, str]] = [
    ("host", str, "address to listen on (default 127.0.0.1)"),
    ("block_size", int, "KV block size of the workers (default: the first worker's)"),
    ("prefill_weight", float, "kv policy: cost per uncached prompt block (default 1.0)"),
    ("load_weight", float, "kv policy: cost per block of requests in flight on the worker (default 0.5)"),
    (
        "temperature",
        float,
        "kv policy: softmax temperature over normalised costs; 0 picks the cheapest (default)",
    ),
    ("hot_spot_factor", float, "skip workers above factor x mean requests in flight (+ slack) (default 1.5)"),
    ("hot_spot_slack", float, "requests allowed above the hot-spot limit (default 1)"),
    ("predicted_ttl", float, "seconds an assignment counts as cached before events confirm it (default 10)"),
    ("health_interval", float, "seconds between health checks (default 1)"),
    ("max_attempts", int, "workers a request is tried on when one fails before any byte (default 3)"),
    ("disagg_threshold", int, "prefill remotely when at least this many prompt tokens are uncached (default 256)"),
    ("max_prefills_in_flight", int, "prompts a prefill worker may have in progress before prefill stays local "
                                    "(default 2)"),
    ("seed", int, "seed of the random choices"),
    ("log_level", str, "log level (default info)"),
    ("shadow", shadow_arg, "mirror requests to this candidate deployment too, fire-and-forget (its answers reach no "
                           "client), and compare its answers with the primary's: a URL, or a JSON object of shadow "
                           "settings, e.g. '{\"url\": \"http://127.0.0.1:8100\", \"sample\": 0.1, \"score\": 0.5, "
                           "\"record\": \"pairs.jsonl\"}' (kvyard/shadow/mirror.py ShadowSettings; #37)"),
]


def _add_router_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policy", choices=POLICIES, default="kv")
    p.add_argument(
        "--model",
        default=None,
        help="the model the workers serve: the router hashes prompts with its tokenizer (default: the deployment "
             "file's engine.model, else smollm2-135m)",
    )
    for name, kind, help_text in _ROUTER_FLAGS:
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=None, help=help_text)
    p.add_argument("--api-key", default=None,
                   help="clients must send `Authorization: Bearer KEY` (every route but /health); also the key "
                        "sent to workers unless --worker-api-key is given (default: $KVYARD_API_KEY, else none)")
    p.add_argument("--worker-api-key", default=None, help="the key the router sends to workers (default: --api-key)")


def add_route_parsers(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    route = sub.add_parser(
        "route", help="OpenAI-compatible router over kvyard workers (cache-aware placement)"
    )
    route.add_argument(
        "--worker", action="append", default=[], metavar="URL", help="a worker; repeat for more"
    )
    route.add_argument("--port", type=int, default=8000)
    _add_router_flags(route)
    route.set_defaults(func=cmd_route)

    up = sub.add_parser("up", help="start N `kvyard serve` workers and the router in one command")
    up.add_argument("--config", default=None,
                    help="YAML deployment file: `engine:` and `server:` for every worker, `cluster:` for the "
                         "deployment (replicas, placement, autoscaling); flags override it")
    up.add_argument("--replicas", type=int, default=None, help="colocated workers (role both; default 2)")
    up.add_argument("--prefill", type=int, default=None, help="disaggregated: prefill workers (with --decode)")
    up.add_argument("--decode", type=int, default=None, help="disaggregated: decode workers (with --prefill)")
    up.add_argument("--router-port", type=int, default=8000)
    up.add_argument(
        "--worker-port", type=int, default=None, help="first worker's port (default: router port + 1)"
    )
    up.add_argument(
        "--worker",
        action="append",
        default=[],
        metavar="URL",
        help="also route to this already running worker (e.g. on another machine)",
    )
    up.add_argument(
        "--num-threads", type=int, default=None, help="torch threads per worker (default: cores / N)"
    )
    up.add_argument(
        "--serve-args", default=None, help='more `kvyard serve` flags for each worker, e.g. "--dtype float32"'
    )
    up.add_argument("--log-dir", default=None, help="write worker logs here instead of the terminal")
    up.add_argument("--restart-backoff", type=float, default=1.0,
                    help="seconds before a dead worker is started again, doubled while it keeps dying (up to "
                         "30); 0: never restart (default 1)")
    up.add_argument(
        "--ray", nargs="?", const="", default=None, metavar="ADDRESS",
        help="place the replicas on a Ray cluster as actors: auto, ray://host:port or a GCS address; "
             "without an address a local Ray instance is started",
    )
    up.add_argument("--cpus-per-replica", type=int, default=None,
                    help="--ray: CPUs each replica's placement group reserves (and its torch threads; default 1)")
    up.add_argument("--placement-strategy", default=None, help="--ray: PACK (default) or SPREAD")
    up.add_argument("--placement-timeout", type=float, default=None,
                    help="--ray: seconds to wait for a replica's resources before failing (default 30)")
    _add_router_flags(up)
    up.set_defaults(func=cmd_up)


def router_settings(args: argparse.Namespace, workers: list[str], port: int, cluster_token: str | None = None) -> Any:
    from kvyard.router.config import RouterSettings

    given = {n: getattr(args, n) for n, _, _ in _ROUTER_FLAGS if getattr(args, n) is not None}
    return RouterSettings(workers=workers, model=args.model, policy=args.policy, port=port, api_key=api_key(args),
                          worker_api_key=args.worker_api_key, cluster_token=cluster_token, **given)


def api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else $KVYARD_API_KEY (as `kvyard serve` reads it), else None."""
    return args.api_key or os.environ.get("KVYARD_API_KEY") or None


def cmd_route(args: argparse.Namespace) -> int:
    from kvyard.router.server import serve_router

    if not args.worker:
        print("kvyard route: error: give at least one --worker URL", file=sys.stderr)
        return 2
    args.model = args.model or DEFAULT_MODEL
    settings = router_settings(args, args.worker, args.port)
    logging.basicConfig(level=settings.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    serve_router(settings)
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    from kvyard.router.launcher import Cluster, ClusterSpec, RestartPolicy, split_args
    from kvyard.router.server import serve_router

    try:
        deploy = load_deploy_config(args.config) if args.config else DeployConfig()
        cluster = cluster_config(args, deploy)
    except ConfigError as e:
        print(f"kvyard up: error: {e}", file=sys.stderr)
        return 2
    args.model = args.model or deploy.engine.get("model") or DEFAULT_MODEL
    roles = cluster.roles()
    if args.ray is not None:
        return _up_on_ray(args, cluster, deploy)
    spec = ClusterSpec(
        replicas=len(roles),
        roles=roles,
        model=args.model,
        worker_port=args.worker_port or args.router_port + 1,
        host=args.host or "127.0.0.1",
        num_threads=args.num_threads,
        serve_args=(["--config", args.config] if args.config else []) + split_args(args.serve_args),
        log_dir=Path(args.log_dir) if args.log_dir else None,
        api_key=args.worker_api_key or api_key(args),
    )
    if spec.log_dir:
        spec.log_dir.mkdir(parents=True, exist_ok=True)
    settings = router_settings(args, spec.worker_urls() + args.worker, args.router_port, spec.cluster_token)
    logging.basicConfig(level=settings.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    cluster = Cluster(spec)
    # SIGTERM before uvicorn installs its handlers (while workers start) must still stop the workers.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        urls = cluster.start_workers()
        cluster.supervise(RestartPolicy(backoff=args.restart_backoff))
        logging.getLogger("kvyard.up").info(
            "workers %s (%d threads each); router on port %d",
            ", ".join(f"{u} ({r})" for u, r in zip(urls, spec.roles, strict=True)),
            spec.threads(),
            args.router_port,
        )
        serve_router(settings)  # until Ctrl-C / SIGTERM
    finally:
        cluster.stop()
    return 0


def cluster_config(args: argparse.Namespace, deploy: "DeployConfig") -> "ClusterConfig":
    """The deployment file's `cluster:` section with the flags that were given on top."""
    from kvyard.cluster.config import ClusterConfig

    flags = {
        "replicas": args.replicas, "prefill": args.prefill, "decode": args.decode,
        "cpus_per_replica": args.cpus_per_replica, "strategy": args.placement_strategy,
        "placement_timeout": args.placement_timeout, "address": args.ray or None,
    }
    return ClusterConfig(**{**deploy.cluster, **{k: v for k, v in flags.items() if v is not None}})


def _up_on_ray(args: argparse.Namespace, cluster: "ClusterConfig", deploy: "DeployConfig") -> int:
    """`kvyard up --ray`: the same deployment with every replica a Ray actor; the router runs in this driver."""
    from kvyard.cluster.controller import RayController
    from kvyard.router.launcher import split_args
    from kvyard.router.server import serve_router

    host = args.host or "127.0.0.1"
    logging.basicConfig(level=(args.log_level or "info").upper(), format="%(levelname)s %(name)s: %(message)s")
    RayController.connect(cluster.address, host)
    key = args.worker_api_key or api_key(args)
    serve_argv = ["--model", args.model, *split_args(args.serve_args), *(["--api-key", key] if key else [])]
    # The file's engine and server sections travel with each actor: other nodes need not have the file.
    # Each replica binds its own Ray node's address (127.0.0.1 for a local Ray instance); --host is the router's.
    controller = RayController(cluster, serve_argv, cluster.roles(), deploy={"engine": deploy.engine,
                                                                             "server": deploy.server})
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        urls = controller.start_all()
        logging.getLogger("kvyard.up").info("Ray replicas: %s", controller.describe())
        serve_router(router_settings(args, urls + args.worker, args.router_port), controller)
    finally:
        controller.stop()
    return 0
