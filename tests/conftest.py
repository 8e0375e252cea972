import functools
import os
from pathlib import Path

import pytest
import torch
import transformers

from tests.tiny import make_tiny_checkpoint

torch.set_num_threads(2)
# Before anything imports ray (it reads this once): a Ray cluster in tests stays on loopback.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


@pytest.fixture(autouse=True)
def _kv_segments_of_this_test(tmp_path_factory, monkeypatch):
    """The host KV tier's shared-memory files (kv_offload_host_segment=auto) go to a directory of each test's own:
    one test's blocks never show up in another, and /dev/shm keeps nothing."""
    monkeypatch.setenv("KVYARD_SHM_DIR", str(tmp_path_factory.mktemp("shm")))


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """tiny_checkpoint(model_type, tie_word_embeddings=False) -> Path of a random HF checkpoint (cached)."""
    root = tmp_path_factory.mktemp("tiny")

    @functools.cache
    def make(model_type: str = "llama", tie_word_embeddings: bool = False) -> Path:
        out = root / f"{model_type}-{'tied' if tie_word_embeddings else 'untied'}"
        return make_tiny_checkpoint(out, model_type, tie_word_embeddings=tie_word_embeddings)

    return make


@functools.cache
def hf_reference(path: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@functools.cache
def hf_reference_gguf(path: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()


def hf_greedy(model: transformers.PreTrainedModel, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
        eos_token_id=None, pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def assert_greedy_matches(model: transformers.PreTrainedModel, prompt: list[int], got: list[int],
                          tie: float) -> None:
    """`got` is HF's greedy continuation, or leaves it only where HF's own top two logits lie within `tie` of
    each other (fp32 rounding in any other order of sums can pick either) and it took the runner-up there."""
    want = hf_greedy(model, prompt, len(got))
    if got == want:
        return
    i = next(j for j, (a, b) in enumerate(zip(got, want, strict=True)) if a != b)
    with torch.no_grad():
        top = model(torch.tensor([prompt + want[:i]])).logits[0, -1].topk(2)
    gap = float(top.values[0] - top.values[1])
    assert got[i] == int(top.indices[1]) and gap < tie, (
        f"token {i} differs: got {got[i]}, HF {want[i]} (its top two {top.indices.tolist()}, {gap:.2e} apart)")


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from kvyard.loader.registry import resolve_model

    return resolve_model("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_engine(smollm2_path):
    """The real default model behind an AsyncEngine (float32), loaded once for every test that needs it."""
    from kvyard.server.async_engine import AsyncEngine
    from tests.server.conftest import tiny_engine_config

    eng = AsyncEngine.from_config(tiny_engine_config(smollm2_path, kv_cache_memory="64MiB"))
    yield eng
    eng.shutdown()


def pytest_terminal_summary(terminalreporter) -> None:
    """Kernel coverage: which CPU kernel paths this run exercised and which this CPU made it skip."""
    from tests.kernel_coverage import report

    reasons = []
    for rep in terminalreporter.stats.get("skipped", []):
        longrepr = getattr(rep, "longrepr", None)
        if isinstance(longrepr, tuple) and len(longrepr) == 3:
            reasons.append(str(longrepr[2]).removeprefix("Skipped: "))
    terminalreporter.write_sep("-", "kernel coverage on this CPU")
    for line in report(reasons):
        terminalreporter.write_line(line)
