"""Deployment files and flags: unknown keys are errors, flags win over the file."""

from pathlib import Path

import pytest

from kvyard.cli.main import build_parser
from kvyard.cli.serve import configs_from_args
from kvyard.errors import ConfigError, InvalidRequestError
from kvyard.server.config import ServerSettings, load_deploy_config


def write(tmp_path, text: str):
    path = tmp_path / "deploy.yaml"
    path.write_text(text)
    return path


def serve_configs(*argv: str):
    return configs_from_args(build_parser().parse_args(["serve", *argv]))


def test_the_example_file_loads(monkeypatch):
    monkeypatch.delenv("KVYARD_API_KEY", raising=False)
    engine, server = serve_configs("--config", str(Path(__file__).parents[2] / "deploy.example.yaml"))
    assert engine.model == "smollm2-135m" and engine.kv_cache_memory == 2**30
    # A deployment guards against loops (stop); the dataclass default, for code building its own, does not.
    assert server == ServerSettings(repetition_guard={"action": "stop"})


@pytest.mark.parametrize("text, key", [
    ("engin:\n  model: x\n", "engin"),
    ("engine:\n  modle: x\n", "modle"),
    ("server:\n  prot: 80\n", "prot"),
    ("server:\n  model: x\n", "model"),  # an engine key in the wrong section
])
def test_unknown_keys_are_rejected_by_name(tmp_path, text, key):
    with pytest.raises(ConfigError, match=repr(key)) as e:
        load_deploy_config(write(tmp_path, text))
    assert e.value.param == key


@pytest.mark.parametrize("text", [
    "server:\n  port: eighty\n", "engine:\n  block_size: '16'\n", "server:\n  max_queue: true\n",
    "- a\n- b\n", "engine: [1]\n", "engine: {model: [unclosed\n",
])
def test_malformed_files_are_config_errors(tmp_path, text):
    with pytest.raises(ConfigError):
        load_deploy_config(write(tmp_path, text))


def test_flags_override_the_file_and_the_file_overrides_defaults(tmp_path, monkeypatch):
    monkeypatch.delenv("KVYARD_API_KEY", raising=False)
    path = write(tmp_path, "engine:\n  model: from-file\n  block_size: 32\n  enable_chunked_prefill: false\n"
                           "server:\n  port: 9000\n  max_queue: 4\n  request_timeout: null\n")
    engine, server = serve_configs("--config", str(path), "--block-size", "8", "--port", "9100")
    assert engine.model == "from-file" and engine.block_size == 8 and engine.enable_chunked_prefill is False
    assert server.port == 9100 and server.max_queue == 4 and server.request_timeout is None
    engine, _ = serve_configs("--config", str(path), "--enable-chunked-prefill")
    assert engine.enable_chunked_prefill is True
    engine, server = serve_configs()  # no file, no flags: the dataclass defaults
    assert engine.block_size == 16 and server.port == 8000
    assert server.guard.action == "stop" and server.generation_config == "auto"  # but the deployment's guard
    assert server.json_whitespace == "compact"
    assert serve_configs("--json-whitespace", "any")[1].json_whitespace == "any"


def test_api_key_precedence(tmp_path, monkeypatch):
    path = write(tmp_path, "server:\n  api_key: file-key\n")
    monkeypatch.delenv("KVYARD_API_KEY", raising=False)
    assert serve_configs("--config", str(path))[1].api_key == "file-key"
    monkeypatch.setenv("KVYARD_API_KEY", "env-key")
    assert serve_configs("--config", str(path))[1].api_key == "env-key"
    assert serve_configs("--config", str(path), "--api-key", "flag-key")[1].api_key == "flag-key"


def test_bad_values_are_errors():
    with pytest.raises(ConfigError, match="port"):
        ServerSettings(port=70000)
    with pytest.raises(ConfigError, match="json_whitespace"):
        ServerSettings(json_whitespace="pretty")
    with pytest.raises(InvalidRequestError):
        serve_configs("--max-body-bytes", "lots")
    with pytest.raises(ConfigError):
        load_deploy_config("/nonexistent/deploy.yaml")


def test_parallel_layouts_from_flags_and_from_the_file(tmp_path):
    """Model parallelism is set the same way on the command line and under `engine:` (flags win)."""
    engine, _ = serve_configs("--tensor-parallel-size", "2", "--pipeline-parallel-size", "2",
                              "--enable-expert-parallel", "--expert-placement", "round_robin", "--no-bind-threads")
    assert (engine.tensor_parallel_size, engine.pipeline_parallel_size, engine.enable_expert_parallel,
            engine.expert_placement, engine.bind_threads) == (2, 2, True, "round_robin", False)
    path = write(tmp_path, "engine:\n  tensor_parallel_size: 4\n  enable_expert_parallel: true\n"
                           "  tensor_parallel_comm: gloo\n")
    engine, _ = serve_configs("--config", str(path), "--tensor-parallel-size", "2")
    assert (engine.tensor_parallel_size, engine.enable_expert_parallel, engine.tensor_parallel_comm) == (2, True, "gloo")
    with pytest.raises(InvalidRequestError, match="expert_placement must be contiguous or round_robin"):
        serve_configs("--expert-placement", "random")


def test_lora_adapters_from_flags_and_from_the_file(tmp_path):
    engine, server = serve_configs("--lora", "sql=/a/sql", "--lora", "chat=/a/chat", "--enable-lora-runtime-updates")
    assert engine.lora_adapters == {"sql": "/a/sql", "chat": "/a/chat"} and server.enable_lora_runtime_updates
    path = write(tmp_path, "engine:\n  lora_adapters:\n    sql: /b/sql\nserver:\n  enable_lora_runtime_updates: true\n")
    engine, server = serve_configs("--config", str(path))
    assert engine.lora_adapters == {"sql": "/b/sql"} and server.enable_lora_runtime_updates
    assert serve_configs()[0].lora_adapters == {} and not serve_configs()[1].enable_lora_runtime_updates
    with pytest.raises(SystemExit):
        serve_configs("--lora", "no-path")
