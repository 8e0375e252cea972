"""The deployment file's `cluster:` section and the `kvyard up` flags over it (no Ray needed)."""

import pytest

from kvyard.cli.main import build_parser
from kvyard.cli.route import cluster_config
from kvyard.cluster.config import AutoscaleConfig, ClusterConfig
from kvyard.cluster.replica import parse_serve_argv
from kvyard.errors import ConfigError
from kvyard.server.config import load_deploy_config

FILE = """
engine:
  dtype: float32
  kv_cache_memory: 4MiB
server:
  max_queue: 7
cluster:
  replicas: 2
  cpus_per_replica: 2
  strategy: SPREAD
  autoscale:
    min_replicas: 1
    max_replicas: 3
    target_waiting: 4
"""


def up_cluster(tmp_path, text: str, *flags: str) -> ClusterConfig:
    path = tmp_path / "deploy.yaml"
    path.write_text(text)
    args = build_parser().parse_args(["up", "--config", str(path), *flags])
    return cluster_config(args, load_deploy_config(path))


def test_the_file_sets_the_cluster_and_flags_override_it(tmp_path):
    c = up_cluster(tmp_path, FILE)
    assert c.roles() == ["both", "both"] and c.cpus_per_replica == 2 and c.strategy == "SPREAD"
    assert c.bundle() == {"CPU": 2.0} and c.address is None
    assert c.scaling == AutoscaleConfig(min_replicas=1, max_replicas=3, target_waiting=4)
    c = up_cluster(tmp_path, FILE, "--replicas", "3", "--cpus-per-replica", "1", "--placement-strategy", "PACK",
                   "--ray", "auto")
    assert c.roles() == ["both"] * 3 and c.cpus_per_replica == 1 and c.strategy == "PACK" and c.address == "auto"
    c = up_cluster(tmp_path, "cluster:\n  prefill: 1\n  decode: 2\n")
    assert c.roles() == ["prefill", "decode", "decode"] and c.scaling is None


@pytest.mark.parametrize(("text", "param"), [
    ("cluster:\n  replica: 2\n", "replica"),  # a typo is named, with the known keys
    ("cluster:\n  autoscale:\n    max_replica: 3\n", "max_replica"),
    ("cluster:\n  replicas: 0\n", "replicas"),
    ("cluster:\n  prefill: 1\n", "decode"),
    ("cluster:\n  strategy: EVERYWHERE\n", "strategy"),
    ("cluster:\n  replicas: 5\n  autoscale:\n    max_replicas: 4\n", "replicas"),
    ("cluster:\n  autoscale:\n    min_replicas: 3\n    max_replicas: 2\n", "max_replicas"),
    ("cluster:\n  prefill: 1\n  decode: 1\n  autoscale: {}\n", "autoscale"),
    ("clusters:\n  replicas: 2\n", "clusters"),
])
def test_bad_cluster_settings_are_errors_that_name_the_key(tmp_path, text, param):
    with pytest.raises(ConfigError) as e:
        up_cluster(tmp_path, text)
    assert e.value.param == param, str(e.value)


def test_bad_cluster_settings_stop_kvyard_up_with_a_message(tmp_path, capsys):
    path = tmp_path / "deploy.yaml"
    path.write_text("cluster:\n  replicas: 0\n")
    args = build_parser().parse_args(["up", "--config", str(path)])
    assert args.func(args) == 2
    assert "replicas must be >= 1" in capsys.readouterr().err


def test_a_ray_replica_gets_the_files_engine_and_server_sections(tmp_path):
    path = tmp_path / "deploy.yaml"
    path.write_text(FILE)
    sections = load_deploy_config(path)
    engine, server = parse_serve_argv(["--model", "m", "--max-queue", "9"],
                                      {"engine": sections.engine, "server": sections.server})
    assert engine.model == "m" and str(engine.dtype) == "torch.float32" and engine.kv_cache_memory == 4 * 2**20
    assert server.max_queue == 9  # a flag still wins over the file


def test_the_example_files_cluster_section_builds():
    from pathlib import Path

    example = load_deploy_config(Path(__file__).parents[2] / "deploy.example.yaml")
    assert ClusterConfig(**example.cluster).roles() == ["both", "both"]
