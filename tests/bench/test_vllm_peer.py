import shlex
from pathlib import Path

import pytest

from kvyard.bench import vllm_peer
from kvyard.bench.compare_serve import parse_systems, peer_systems
from kvyard.bench.serve_run import BenchError


def test_command_is_tuned_as_vllms_cpu_guide_says(tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_peer, "VENV", tmp_path / "venv")
    monkeypatch.setattr(vllm_peer, "TCMALLOC", tmp_path / "libtcmalloc_minimal.so.4")
    (tmp_path / "libtcmalloc_minimal.so.4").touch()
    cmd = vllm_peer.command(Path("/models/smollm2"), threads=2)
    argv = shlex.split(cmd.format(port=8123))
    env = dict(a.split("=", 1) for a in argv[1:4])
    assert argv[0] == "env" and env["VLLM_CPU_KVCACHE_SPACE"] == "1" and env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert env["LD_PRELOAD"].split(":") == [str(tmp_path / "venv/lib/libiomp5.so"),
                                            str(tmp_path / "libtcmalloc_minimal.so.4")]
    # The venv's own python (a link to the base one: it must not be resolved), by module, not the `vllm` script.
    assert argv[4] == str(tmp_path / "venv/bin/python") and argv[5:7] == ["-m", "vllm.entrypoints.openai.api_server"]
    flags = " ".join(argv[7:])
    assert "--model /models/smollm2 --host 127.0.0.1 --port 8123 --dtype bfloat16" in flags
    assert "--enable-prefix-caching" in flags and "--enable-chunked-prefill" in flags


def test_without_tcmalloc_only_intels_openmp_is_preloaded(tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_peer, "VENV", tmp_path)
    monkeypatch.setattr(vllm_peer, "TCMALLOC", tmp_path / "absent.so")
    env = shlex.split(vllm_peer.command(Path("/m"), threads=1))[1:4]
    assert f"LD_PRELOAD={tmp_path}/lib/libiomp5.so" in env and "VLLM_CPU_OMP_THREADS_BIND=0-0" in env


def test_the_peer_needs_its_venv(tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_peer, "VENV", tmp_path / "nowhere")
    with pytest.raises(BenchError, match="make vllm-peer"):
        peer_systems("vllm", "smollm2-135m")
    assert peer_systems(None, "smollm2-135m") == []


def test_peer_systems_put_kvyard_first(tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_peer, "VENV", tmp_path)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin/python").touch()
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib/libiomp5.so").touch()
    monkeypatch.setattr(vllm_peer, "export", lambda model: tmp_path / "models" / model)
    systems = parse_systems(peer_systems("vllm", "smollm2-135m"))
    assert list(systems) == ["kvyard", "vllm-cpu"]
    assert "serve --model smollm2-135m --port {port}" in systems["kvyard"]
    assert f"--model {tmp_path}/models/smollm2-135m" in systems["vllm-cpu"]
