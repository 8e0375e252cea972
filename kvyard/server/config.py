"""Server settings and the YAML deployment file that sets them together with the engine's.

A deployment file has up to three optional sections, each a mapping of field names:

    engine:            # any EngineConfig field
      model: smollm2-135m
      kv_cache_memory: 2GiB
    server:            # any ServerSettings field
      port: 8000
      max_queue: 128
    cluster:           # any ClusterConfig field: what `kvyard up` deploys (`kvyard serve` ignores it)
      replicas: 2

Nested sections, not one flat mapping, so that a name can never be ambiguous and a typo is reported
with the section it was found in. Precedence: dataclass defaults < the file < command-line flags.
"""

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kvyard.cluster.config import ClusterConfig
from kvyard.config import EngineConfig, check_fields, parse_bytes, section_setting
from kvyard.errors import ConfigError, InvalidRequestError
from kvyard.server.repetition import RepetitionGuard, guard_setting
from kvyard.shadow.capture import CaptureSettings
from kvyard.structured.spec import JSON_WHITESPACE
from kvyard.vision.config import GraftConfig, is_graft

ROLES = ("both", "prefill", "decode")
GENERATION_CONFIGS = ("auto", "none")
# What a deployment (`kvyard serve`, `make serve`) does about loops unless its file or flags say otherwise.
# The dataclass default stays off: code that builds ServerSettings itself (tests, embedders) opts in.
DEPLOYMENT_GUARD_ACTION = "stop"


@dataclass
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # when set, every route but /health needs `Authorization: Bearer KEY`
    # When set, /kv/* and the ZeroMQ endpoints (KV events, KV transfer) admit only the fleet: this token, given
    # by `kvyard up` in $KVYARD_CLUSTER_TOKEN (kvyard/cluster/auth.py), or the API key on /kv/*.
    cluster_token: str | None = dataclasses.field(default=None, repr=False)
    # Requests refused with 429 once this many are queued (waiting in the engine or about to be); None: no limit.
    max_queue: int | None = 256
    max_body_bytes: int | str = "1MiB"
    request_timeout: float | None = 600.0  # seconds from arrival to the last token; None: no deadline
    drain_timeout: float = 30.0  # seconds in-flight requests get to finish after SIGTERM
    served_model_name: str | None = None  # default: the engine's model name
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter change the served adapters (vLLM's
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING); off, they answer 404
    enable_lora_runtime_updates: bool = False
    log_level: str = "info"
    # What to do when a generation loops: {action: off|stop|retry, max_retries, min_count, ...}
    # (kvyard/server/repetition.py); requests may override it. A mapping here, a RepetitionGuard after.
    repetition_guard: RepetitionGuard | dict[str, Any] | None = None
    # Sampling defaults for parameters a request leaves out: "auto", the model's own (generation_config.json
    # or GGUF metadata, as vLLM's --generation-config auto); "none", kvyard's SamplingParams defaults.
    generation_config: str = "auto"
    # Whitespace in constrained JSON: compact (default) or any, bounded per gap (kvyard/structured/compiler.py)
    json_whitespace: str = "compact"
    # Publish KV cache events for a cache-aware router on this ZeroMQ port (0: any free port); None: off.
    kv_events_port: int | None = None
    # Prefill/decode disaggregation (kvyard/server/disagg.py). prefill: computes prompts' KV for decode
    # workers (POST /kv/prefill); decode: pulls KV named by a request's `kv_transfer_params`; both: either.
    role: str = "both"
    kv_transfer_port: int | None = None  # the prefill side's ZeroMQ port for KV pulls (0: any free port)
    kv_transfer_mode: str = "layers"  # layers: one message per layer, pipelined (measured faster); blocks: one
    kv_hold_timeout: float = 30.0  # seconds a prefill worker keeps KV nobody has pulled
    kv_fetch_timeout: float = 10.0  # seconds a decode worker waits for a pull before prefilling itself
    # Traffic capture (kvyard/shadow/capture.py): a directory, or {dir, sample, redact, file_bytes, max_bytes,
    # queue}; None: off
    capture: CaptureSettings | dict[str, Any] | str | None = None
    # A vision graft's directory (kvyard graft vision): its encoder and projector turn chat requests' images into
    # soft tokens for the engine's model, the graft's language model. Set by `--model GRAFTDIR`.
    graft: str | None = None

    def __post_init__(self) -> None:
        self.max_body_bytes = parse_bytes(self.max_body_bytes)
        self.capture = section_setting(CaptureSettings, self.capture, "server: capture", shorthand="dir")
        try:
            self.repetition_guard = guard_setting(self.repetition_guard)
        except InvalidRequestError as e:
            raise ConfigError(f"server setting {e}", param=e.param) from None
        checks = [
            ("port", 0 <= self.port <= 65535, "must be in [0, 65535]"),
            ("max_queue", self.max_queue is None or self.max_queue >= 0, "must be >= 0"),
            ("max_body_bytes", self.max_body_bytes >= 1024, "must be at least 1KiB"),
            ("request_timeout", self.request_timeout is None or self.request_timeout > 0, "must be > 0"),
            ("drain_timeout", self.drain_timeout >= 0, "must be >= 0"),
            ("api_key", self.api_key is None or bool(self.api_key), "must not be empty"),
            ("cluster_token", self.cluster_token is None or len(self.cluster_token) >= 16, "must be 16 characters or more"),
            ("role", self.role in ROLES, f"must be one of {', '.join(ROLES)}"),
            ("generation_config", self.generation_config in GENERATION_CONFIGS,
             f"must be one of {', '.join(GENERATION_CONFIGS)}"),
            ("json_whitespace", self.json_whitespace in JSON_WHITESPACE,
             f"must be one of {', '.join(JSON_WHITESPACE)}"),
            ("kv_transfer_port", self.kv_transfer_port is None or 0 <= self.kv_transfer_port <= 65535,
             "must be in [0, 65535]"),
            ("kv_transfer_mode", self.kv_transfer_mode in ("blocks", "layers"), "must be blocks or layers"),
            ("kv_hold_timeout", self.kv_hold_timeout > 0, "must be > 0"),
            ("kv_fetch_timeout", self.kv_fetch_timeout > 0, "must be > 0"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise ConfigError(f"server setting {name} {why}, got {getattr(self, name)!r}", param=name)

    @property
    def guard(self) -> RepetitionGuard:
        assert isinstance(self.repetition_guard, RepetitionGuard)  # __post_init__ made it one
        return self.repetition_guard


@dataclass
class DeployConfig:
    """The two sections of a deployment file, checked against their dataclasses but not yet built."""

    engine: dict[str, Any] = dataclasses.field(default_factory=dict)
    server: dict[str, Any] = dataclasses.field(default_factory=dict)
    cluster: dict[str, Any] = dataclasses.field(default_factory=dict)  # `kvyard up` only (kvyard/cluster/config.py)


SECTION_TYPES: dict[str, type] = {"engine": EngineConfig, "server": ServerSettings, "cluster": ClusterConfig}


def load_deploy_config(path: str | Path) -> DeployConfig:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ConfigError(f"cannot read the deployment file {path}: {e.strerror}", param="config") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {e}", param="config") from e
    if data is None:
        return DeployConfig()
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of 'engine', 'server' and 'cluster' sections",
                          param="config")
    config = DeployConfig()
    for section, body in data.items():
        if section not in SECTION_TYPES:
            raise ConfigError(
                f"{path}: unknown key {section!r}; the top level has only 'engine', 'server' and 'cluster'",
                param=str(section),
            )
        if body is None:
            continue
        if not isinstance(body, dict):
            raise ConfigError(f"{path}: section {section!r} must be a mapping", param=section)
        setattr(config, section, check_fields(SECTION_TYPES[section], body, f"{path}: {section}"))
    return config


def build_configs(
    deploy: DeployConfig | None, engine_flags: dict[str, Any], server_flags: dict[str, Any]
) -> tuple[EngineConfig, ServerSettings]:
    """Merge defaults, the file and the flags that were given explicitly (later wins).

    The repetition guard of a deployment is on (`stop`) unless the file or `--repetition-guard` names
    another action; the flag, an action name, keeps the file's detection settings.
    """
    deploy = deploy or DeployConfig()
    engine = {**deploy.engine, **engine_flags}
    server = {**deploy.server, **server_flags}
    guard = deploy.server.get("repetition_guard")
    if isinstance(guard, dict) or guard is None:
        server["repetition_guard"] = {"action": DEPLOYMENT_GUARD_ACTION, **(guard or {})}
    action = server_flags.get("repetition_guard")
    if isinstance(action, str):
        server["repetition_guard"] = {**(guard if isinstance(guard, dict) else {}), "action": action}
    check_fields(EngineConfig, engine, "engine")
    check_fields(ServerSettings, server, "server")
    if is_graft(engine.get("model")):
        # The graft's directory is served as its language model, with images; it names the served model
        server["graft"] = str(engine["model"])
        server.setdefault("served_model_name", Path(engine["model"]).expanduser().resolve().name)
        engine["model"] = GraftConfig.read(engine["model"]).model
    return EngineConfig(**engine), ServerSettings(**server)
