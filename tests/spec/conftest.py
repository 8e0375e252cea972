import json

import pytest

from kvyard import LLM
from kvyard.spec.speculator.train import TrainConfig, train_speculator
from tests.tiny import make_tiny_checkpoint


@pytest.fixture(scope="session")
def target_path(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="session")
def small_draft_path(tmp_path_factory):
    """A 1-layer llama with other random weights and the same tiny tokenizer: a poor drafter."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("draft") / "d1", "llama", num_layers=1, seed=7)


@pytest.fixture(scope="session")
def base_llm(target_path):
    return LLM(str(target_path), dtype="float32", max_num_batched_tokens=64)


def spec_llm(path, **options) -> LLM:
    return LLM(
        str(path),
        dtype="float32",
        max_num_batched_tokens=options.pop("max_num_batched_tokens", 64),
        **options,
    )


def run_steps(llm: LLM, requests: list, late: list | None = None, after: int = 3) -> dict:
    """Add (prompt, params) requests, step to completion; add the `late` ones after `after` steps."""
    eng = llm.engine
    ids = [eng.add_request(p, sp) for p, sp in requests]
    done, steps = {}, 0
    while eng.has_unfinished_requests() or late:
        if late and steps == after:
            ids += [eng.add_request(p, sp) for p, sp in late]
            late = None
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
        steps += 1
    return {i: done[rid] for i, rid in enumerate(ids)}


TRAIN_PROMPTS = ["The quick brown fox", "def add(a, b):", "Paged attention keeps the", "x y z", "print(add"]


@pytest.fixture(scope="session")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "train.jsonl"
    lines = [{"prompt": p} for p in TRAIN_PROMPTS] + [{"prompt": p, "raw": True} for p in TRAIN_PROMPTS]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return path


@pytest.fixture(scope="session")
def speculator_dir(target_path, prompts_file, tmp_path_factory):
    """One layer from the target's last, a 128-token draft vocabulary, a few steps of training."""
    out = tmp_path_factory.mktemp("spec") / "speculator"
    summary = train_speculator(TrainConfig(
        target=str(target_path), prompts=str(prompts_file), out=str(out), init_layers=[-1], draft_vocab=128,
        max_tokens=24, epochs=2, batch_tokens=128, holdout=0.2, dtype="float32", kv_cache_memory="8MiB",
        progress=False,
    ))
    assert summary["samples"] == 8 and summary["heldout"]["positions"] > 0
    return out
