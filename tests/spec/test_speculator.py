"""Trained speculators: train on a tiny target, serve it losslessly, refuse it for another target."""

import json

import pytest

from kvyard import LLM, SamplingParams
from kvyard.cli.main import main
from kvyard.errors import CheckpointError
from kvyard.spec.speculator.evaluate import Replay, replay
from kvyard.spec.speculator.format import CONFIG_NAME, SpeculatorMismatchError, read_speculator_config
from kvyard.spec.speculator.model import choose_draft_vocab
from tests.spec.test_engine_spec import PROMPTS, token_ids
from tests.tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def reference(base_llm):
    return token_ids(base_llm, PROMPTS)


def test_trained_speculator_is_lossless(target_path, speculator_dir, reference):
    cfg = read_speculator_config(speculator_dir)
    assert cfg.num_layers == 1 and cfg.draft_vocab_size == 128 and cfg.init_layers == [1]
    llm = LLM(str(target_path), dtype="float32", max_num_batched_tokens=64, speculator=str(speculator_dir),
              num_speculative_tokens=3)
    assert llm.engine.cfg.speculative_method == "speculator"
    assert token_ids(llm, PROMPTS) == reference
    stats = llm.engine.spec.stats
    assert stats.proposed_tokens > 0 and stats.accepted_tokens > 0
    # Sampled requests go through rejection sampling with the same drafter.
    out = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=12, temperature=1.0, seed=1, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in out] == [12, 12]


def test_speculator_for_another_target_is_refused(speculator_dir, tmp_path):
    other = make_tiny_checkpoint(tmp_path / "other", "llama", seed=3)
    with pytest.raises(SpeculatorMismatchError, match=f"{CONFIG_NAME}: this speculator was trained for target"):
        LLM(str(other), dtype="float32", speculator=str(speculator_dir))


def test_missing_speculator_is_a_checkpoint_error(target_path, tmp_path):
    with pytest.raises(CheckpointError, match="speculator.json: no such file"):
        LLM(str(target_path), dtype="float32", speculator=str(tmp_path))


def test_cli_trains_a_speculator(target_path, prompts_file, tmp_path, capsys):
    out = tmp_path / "cli-spec"
    rc = main(["speculator", "train", "--target", str(target_path), "--prompts", str(prompts_file), "--out",
               str(out), "--init-layers", "0", "--max-tokens", "8", "--epochs", "1", "--dtype", "float32",
               "--loss", "hard", "--draft-vocab", "0", "--no-prompt-lookup"])
    assert rc == 0 and (out / "model.safetensors").is_file()
    summary = json.loads(capsys.readouterr().out)
    assert summary["loss"] == "hard" and summary["samples"] > 0
    cfg = read_speculator_config(out)
    assert cfg.draft_vocab_size == 400 and not cfg.prompt_lookup  # 0: the whole vocabulary


def test_draft_vocab_takes_frequent_tokens_then_low_ids():
    from collections import Counter

    vocab = choose_draft_vocab(Counter({50: 9, 7: 5, 300: 1}), 400, 5, always=(2,))
    assert vocab.tolist() == [0, 2, 7, 50, 300]
    assert len(choose_draft_vocab(Counter(), 400, 0)) == 400


def test_replay_counts_what_verification_accepts():
    # Output [1..6] after a 2-token prompt; the model's argmax for output 2 is wrong. Token 0 is the prefill's.
    assert replay([10, 11, 1, 2, 3, 4, 5, 6], 2, [0, 2, 9, 4, 5, 6], 2, False) == Replay(2, 4, 3)
    # The output repeats the prompt: lookup drafts [7, 8] once "5 6" has been seen again; the model never helps.
    tokens, wrong = [5, 6, 7, 8, 5, 6, 7, 8, 1], [0] * 5
    assert replay(tokens, 4, wrong, 2, True) == Replay(2, 4, 2)
    assert replay(tokens, 4, wrong, 2, False) == Replay(3, 5, 0)
