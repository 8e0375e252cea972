"""The deployments `kvyard tune` tries: a base deployment file and the knobs it sweeps (#38).

A candidate is a whole deployment: the base file's `engine`, `server` and `cluster` sections with some knobs
set. Knobs are named `section.field` (`engine.max_num_seqs`, `cluster.replicas`) and take a list of values,
given in a space file

    engine:
      max_num_seqs: [8, 32, 64]
      enable_chunked_prefill: [true, false]
    cluster:
      replicas: [1, 2]

or on the command line (`--knob engine.max_num_seqs=8,32,64`). The candidates are the base itself and every
combination of the knobs' values, in a fixed order, each named by a hash of its settings so that a resumed
sweep recognises the ones it already ran.
"""

import dataclasses
import hashlib
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvyard.config import check_fields, parse_bytes
from kvyard.errors import ConfigError, InvalidRequestError
from kvyard.server.config import SECTION_TYPES, DeployConfig, load_deploy_config

SECTIONS = ("engine", "server", "cluster")
# Knobs whose values change what the model computes: a candidate that sets them passes the fidelity gate first.
NUMERIC_KNOBS = frozenset({("engine", "quantization"), ("engine", "kv_cache_dtype"), ("engine", "dtype")})
# Knobs that only grow memory as they grow: past a value that ran out of memory, larger ones are not tried.
GROWS_MEMORY = frozenset({("engine", "max_num_seqs"), ("engine", "max_num_batched_tokens"),
                          ("engine", "kv_cache_memory"), ("engine", "num_speculative_tokens")})
KnobName = tuple[str, str]


@dataclass(frozen=True)
class Candidate:
    settings: dict[str, dict[str, Any]] = field(default_factory=dict)  # section -> field -> value, base included
    knobs: dict[KnobName, Any] = field(default_factory=dict)  # what this candidate sets over the base

    @property
    def key(self) -> str:
        """A hash of what the deployment runs with: a setting equal to its default counts as left out."""
        effective = {s: {n: v for n, v in body.items() if v != _default(s, n)} for s, body in self.settings.items()}
        return hashlib.sha256(json.dumps(effective, sort_keys=True, default=str).encode()).hexdigest()[:12]

    @property
    def label(self) -> str:
        return ", ".join(f"{f}={v}" for (_, f), v in self.knobs.items()) or "default"

    @property
    def replicas(self) -> int:
        """Engine processes the candidate runs: the cluster section's, else one `kvyard serve`."""
        c = self.settings.get("cluster")
        if not c:
            return 1
        return int(c.get("prefill", 0)) + int(c.get("decode", 0)) or int(c.get("replicas", 2))

    def changes_numerics(self, base: "Candidate") -> bool:
        return any(self.value(k) != base.value(k) for k in NUMERIC_KNOBS)

    def value(self, knob: KnobName) -> Any:
        section, name = knob
        return self.settings.get(section, {}).get(name, _default(section, name))

    def deployment_yaml(self) -> str:
        return deployment_yaml(self.settings)


def deployment_yaml(settings: dict[str, dict[str, Any]]) -> str:
    """A deployment file of these sections (the empty ones left out), as `kvyard serve/up --config` reads it."""
    return yaml.safe_dump({s: body for s, body in settings.items() if body}, sort_keys=False)


def _default(section: str, name: str) -> Any:
    """What leaving a setting out means. No cluster section is one `kvyard serve`, not the cluster defaults, so
    a cluster setting has no default to stand for it."""
    if section == "cluster":
        return None
    for f in dataclasses.fields(SECTION_TYPES[section]):
        if f.name == name:
            return f.default if f.default is not dataclasses.MISSING else None
    return None


def parse_knob(text: str) -> tuple[KnobName, list[Any]]:
    """`engine.max_num_seqs=8,32,64` -> (("engine", "max_num_seqs"), [8, 32, 64]); values are read as YAML."""
    name, sep, values = text.partition("=")
    section, dot, field_name = name.strip().partition(".")
    if not sep or not dot or section not in SECTIONS or not field_name:
        raise ConfigError(f"--knob {text!r}: expected section.field=v1,v2 with section one of {', '.join(SECTIONS)}",
                          param="knob")
    return (section, field_name), [yaml.safe_load(v) for v in values.split(",")]


def read_space(path: str | Path) -> dict[KnobName, list[Any]]:
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"cannot read the tuning space {path}: {e}", param="space") from e
    if not isinstance(data, dict) or any(s not in SECTIONS or not isinstance(b, dict) for s, b in data.items()):
        raise ConfigError(f"{path}: expected sections {', '.join(SECTIONS)}, each a mapping of field: [values]",
                          param="space")
    return {(s, f): v if isinstance(v, list) else [v] for s, body in data.items() for f, v in body.items()}


def candidates(base: DeployConfig, space: dict[KnobName, list[Any]]) -> list[Candidate]:
    """The base first, then every combination of the knobs' values (each checked against its section)."""
    base_settings = {s: dict(getattr(base, s)) for s in SECTIONS}
    out = [Candidate(base_settings)]
    names = list(space)
    for values in itertools.product(*(space[n] for n in names)):
        settings = {s: dict(body) for s, body in base_settings.items()}
        for (section, name), v in zip(names, values, strict=True):
            settings[section][name] = v
        for section, body in settings.items():
            if body:
                check_fields(SECTION_TYPES[section], body, f"tuning space: {section}")
        # the knobs this candidate changes from the base (its label, and what an OOM is blamed on)
        knobs = {n: v for n, v in zip(names, values, strict=True) if v != out[0].value(n)}
        c = Candidate(settings, knobs)
        if all(c.key != o.key for o in out):
            out.append(c)
    return out


def load_base(path: str | None, model: str | None) -> DeployConfig:
    """The default deployment the sweep starts from (and is compared with): a file, or kvyard's defaults."""
    base = load_deploy_config(path) if path else DeployConfig()
    if model:
        base.engine["model"] = model
    return base


def larger_than_failed(c: Candidate, failed: Candidate) -> bool:
    """True when `c` differs from a candidate that ran out of memory only in knobs that grow memory, each at
    least as large: it would run out too."""
    differs = [k for k in set(c.knobs) | set(failed.knobs) if c.value(k) != failed.value(k)]
    return bool(differs) and all(
        k in GROWS_MEMORY and _number(c.value(k)) is not None and _number(failed.value(k)) is not None
        and _number(c.value(k)) >= _number(failed.value(k)) for k in differs)  # type: ignore[operator]


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, int | float):
        return float(v)
    try:
        return float(parse_bytes(v))
    except (InvalidRequestError, ValueError, TypeError):
        return None
