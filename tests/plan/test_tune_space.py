"""The candidates `kvyard tune` sweeps: knobs parsed, combined over a base, named stably; what an OOM rules out."""

import pytest

from kvyard.errors import ConfigError
from kvyard.plan.tune_space import (
    Candidate,
    candidates,
    larger_than_failed,
    load_base,
    parse_knob,
    read_space,
)


def test_parse_knob_reads_values_as_yaml():
    assert parse_knob("engine.max_num_seqs=8,32") == (("engine", "max_num_seqs"), [8, 32])
    assert parse_knob("engine.enable_chunked_prefill=true,false") == (("engine", "enable_chunked_prefill"),
                                                                      [True, False])
    for bad in ("max_num_seqs=8", "engine.max_num_seqs", "gpu.x=1"):
        with pytest.raises(ConfigError):
            parse_knob(bad)


def test_candidates_are_the_base_then_every_combination(tmp_path):
    base_file = tmp_path / "base.yaml"
    base_file.write_text("engine:\n  max_num_seqs: 1\n")
    space_file = tmp_path / "space.yaml"
    space_file.write_text("engine:\n  max_num_seqs: [1, 8]\n  kv_cache_dtype: [auto, int8]\n")
    cands = candidates(load_base(str(base_file), "smollm2-135m"), read_space(space_file))
    # the base, then 4 combinations less the one equal to the base (max_num_seqs=1, kv auto); each named by
    # what it changes
    assert [c.label for c in cands] == ["default", "kv_cache_dtype=int8", "max_num_seqs=8",
                                        "max_num_seqs=8, kv_cache_dtype=int8"]
    assert all(c.settings["engine"]["model"] == "smollm2-135m" for c in cands)
    assert len({c.key for c in cands}) == 4
    # a key depends on the settings alone, so a resumed sweep finds its rows again
    again = candidates(load_base(str(base_file), "smollm2-135m"), read_space(space_file))
    assert [c.key for c in again] == [c.key for c in cands]
    assert [c.changes_numerics(cands[0]) for c in cands] == [False, True, False, True]


def test_a_knob_of_the_wrong_type_or_name_is_refused():
    with pytest.raises(ConfigError, match="max_num_seqs"):
        candidates(load_base(None, None), {("engine", "max_num_seqs"): ["many"]})
    with pytest.raises(ConfigError, match="unknown key"):
        candidates(load_base(None, None), {("engine", "max_num_seq"): [8]})


def test_replicas_come_from_the_cluster_section():
    assert Candidate({"engine": {}}).replicas == 1
    assert Candidate({"cluster": {"replicas": 3}}).replicas == 3
    assert Candidate({"cluster": {"prefill": 1, "decode": 2}}).replicas == 3


def test_what_ran_out_of_memory_rules_out_larger_settings_only():
    failed = Candidate({"engine": {"max_num_seqs": 64, "kv_cache_memory": "1GiB"}},
                       {("engine", "max_num_seqs"): 64, ("engine", "kv_cache_memory"): "1GiB"})

    def cand(seqs, memory, chunked=True):
        knobs = {("engine", "max_num_seqs"): seqs, ("engine", "kv_cache_memory"): memory,
                 ("engine", "enable_chunked_prefill"): chunked}
        return Candidate({"engine": {n: v for (_, n), v in knobs.items()}}, knobs)

    assert larger_than_failed(cand(128, "2GiB"), failed)
    assert larger_than_failed(cand(64, "2GiB"), failed)
    assert not larger_than_failed(cand(32, "2GiB"), failed)  # fewer sequences may fit
    assert not larger_than_failed(cand(128, "2GiB", chunked=False), failed)  # another knob changed too
