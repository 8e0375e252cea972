"""Reading PEFT adapters: what is refused, with the file and the reason, and what a request may name."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvyard import LLM, SamplingParams
from kvyard.errors import InvalidRequestError
from kvyard.lora.adapter import AdapterError, load_adapter, pattern_value
from tests.lora.adapters import make_adapter


@pytest.fixture(scope="module")
def adapter(tiny_checkpoint, tmp_path_factory):
    base = tiny_checkpoint("llama")
    return base, make_adapter(base, tmp_path_factory.mktemp("adapter") / "a")


def _config_of(base):
    from kvyard.loader.checkpoint import load_checkpoint

    return load_checkpoint(base).config


def _copy(src, dst, config_edit=None, tensors_edit=None):
    dst.mkdir()
    config = json.loads((src / "adapter_config.json").read_text())
    if config_edit:
        config_edit(config)
    (dst / "adapter_config.json").write_text(json.dumps(config))
    tensors = load_file(src / "adapter_model.safetensors")
    if tensors_edit:
        tensors_edit(tensors)
    save_file(tensors, dst / "adapter_model.safetensors")
    return dst


def test_ranks_and_scales_follow_the_config(adapter):
    base, path = adapter
    a = load_adapter("a", path, _config_of(base))
    assert a.max_rank == 4 and {m for _, m in a.modules} == {"q_proj", "v_proj"}
    assert len(a.digest) == 64
    assert pattern_value({"down_proj": 6}, "model.layers.0.mlp.down_proj", 2) == 6
    assert pattern_value({"layers.1.mlp.down_proj": 6}, "model.layers.0.mlp.down_proj", 2) == 2


@pytest.mark.parametrize("case, message", [
    ("dora", "use_dora=True is not supported"),
    ("bias", "bias='all' is not supported"),
    ("unknown target", "target module(s) lm_head are not supported"),
    ("wrong rank", "rank 8 on this model needs"),
    ("foreign tensor", "is not a LoRA pair of a module kvyard adapts"),
    ("layer out of range", "adapts layer 7; the base model has 2"),
    ("half a pair", "without its pair"),
])
def test_bad_adapters_are_refused_naming_the_file(adapter, tmp_path, case, message):
    base, path = adapter
    def rename_layer(t):
        for name in list(t):
            t[name.replace("layers.1.", "layers.7.")] = t.pop(name)
    edits = {
        "dora": dict(config_edit=lambda c: c.update(use_dora=True)),
        "bias": dict(config_edit=lambda c: c.update(bias="all")),
        "unknown target": dict(config_edit=lambda c: c.update(target_modules=["q_proj", "lm_head"])),
        "wrong rank": dict(config_edit=lambda c: c.update(r=8)),
        "foreign tensor": dict(tensors_edit=lambda t: t.update({"base_model.model.lm_head.lora_A.weight": torch.ones(4, 64)})),
        "layer out of range": dict(tensors_edit=rename_layer),
        "half a pair": dict(tensors_edit=lambda t: t.pop(next(n for n in t if "lora_B" in n))),
    }
    bad = _copy(path, tmp_path / "bad", **edits[case])
    with pytest.raises(AdapterError) as e:
        load_adapter("bad", bad, _config_of(base))
    assert message in str(e.value) and str(bad) in str(e.value)


def test_missing_and_corrupt_files(adapter, tmp_path):
    base, path = adapter
    cfg = _config_of(base)
    with pytest.raises(AdapterError, match="adapter_config.json: missing"):
        load_adapter("x", tmp_path, cfg)
    broken = _copy(path, tmp_path / "broken")
    (broken / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(AdapterError, match="adapter_model.safetensors: not a readable safetensors file"):
        load_adapter("x", broken, cfg)


def test_a_request_for_an_unknown_adapter_is_a_clear_error_and_the_engine_goes_on(adapter):
    base, path = adapter
    llm = LLM(str(base), dtype="float32", lora_adapters={"a": str(path)})
    with pytest.raises(InvalidRequestError, match="unknown LoRA adapter 'b' \\(served: a\\)"):
        llm.generate(["hello"], SamplingParams(max_tokens=2), lora="b")
    assert llm.generate(["hello"], SamplingParams(max_tokens=2, ignore_eos=True), lora="a")[0].outputs[0].token_ids
    with pytest.raises(InvalidRequestError, match="serves none"):
        LLM(str(base), dtype="float32").generate(["hello"], SamplingParams(max_tokens=2), lora="a")


def test_an_adapter_replaced_while_in_use_finishes_its_requests_with_the_old_one(adapter, tmp_path):
    """A reload under a busy name (a promotion under live traffic) never waits: the running request ends with the
    adapter it began with, new ones take the new adapter, and the old one goes once its last request is done.
    Unloading a busy adapter is still refused."""
    base, path = adapter
    other = make_adapter(base, tmp_path / "other", seed=7)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    alone = LLM(str(base), dtype="float32", lora_adapters={"old": str(path), "new": str(other)})
    want = {name: alone.generate(["hello"], greedy, lora=name)[0].outputs[0].token_ids for name in ("old", "new")}
    assert want["old"] != want["new"]

    llm = LLM(str(base), dtype="float32", lora_adapters={"a": str(path)})
    engine = llm.engine
    engine.add_request("hello", greedy, request_id="began-with-old", lora="a")
    got = {r.request_id: r for r in engine.step()}  # its prefill and first token ran with the old adapter
    with pytest.raises(InvalidRequestError, match="while 1 request"):
        engine.unload_lora("a")
    engine.load_lora("a", str(other))
    engine.add_request("hello", greedy, request_id="after-the-reload", lora="a")
    while engine.has_unfinished_requests():
        got.update({r.request_id: r for r in engine.step()})
    assert got["began-with-old"].outputs[0].token_ids == want["old"]
    assert got["after-the-reload"].outputs[0].token_ids == want["new"]
    engine.step()  # the retired adapter goes at the next step
    assert list(engine.lora.served) == ["a"] and list(engine.lora.adapters) == ["a"]
    assert engine.lora.served["a"].digest == load_adapter("a", other, engine.model_config).digest


def test_a_memory_budget_keeps_the_recently_used_adapters_and_reloads_the_rest(tiny_checkpoint, tmp_path):
    """Room for two of three adapters: the least recently used idle one makes way, is read again when named,
    and gives the same tokens; adapters requests are running with are never evicted."""
    base = tiny_checkpoint("llama")
    paths = {n: str(make_adapter(base, tmp_path / n, seed=i)) for i, n in enumerate("abc")}
    unlimited = LLM(str(base), dtype="float32", lora_adapters=paths)
    one = unlimited.engine.lora.adapter_bytes(unlimited.engine.lora.adapters["a"])
    llm = LLM(str(base), dtype="float32", lora_adapters=paths, lora_memory=2 * one)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    want = {n: unlimited.generate(["hello there"], greedy, lora=n)[0].outputs[0].token_ids for n in "abc"}
    assert list(llm.engine.lora.adapters) == ["b", "c"]  # a, read first, made way for c at start-up
    for name in "abcab":
        assert llm.generate(["hello there"], greedy, lora=name)[0].outputs[0].token_ids == want[name]
        assert name in llm.engine.lora.adapters and len(llm.engine.lora.adapters) == 2
    loads = llm.engine.lora.loads
    llm.engine.add_request("hello", greedy, lora="a")
    llm.engine.add_request("hello", greedy, lora="b")
    with pytest.raises(InvalidRequestError, match="no room for LoRA adapter 'c'"):
        llm.engine.add_request("hello", greedy, lora="c")
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert llm.generate(["hello there"], greedy, lora="c")[0].outputs[0].token_ids == want["c"]
    assert llm.engine.lora.loads == loads + 1


def test_the_same_file_reloaded_twice_while_busy_keeps_each_generation_apart(adapter):
    base, path = adapter
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    llm = LLM(str(base), dtype="float32", lora_adapters={"a": str(path)})
    engine = llm.engine
    for i in range(3):  # each reload of the same content while a request runs with the previous one
        engine.add_request("hello", greedy, request_id=f"r{i}", lora="a")
        engine.step()
        engine.load_lora("a", str(path))
    assert len(engine.lora.slots) == len(set(engine.lora.slots)) == 4  # three retired generations and "a"
    got = {}
    while engine.has_unfinished_requests():
        got.update({r.request_id: r.outputs[0].token_ids for r in engine.step()})
    engine.step()
    assert list(engine.lora.served) == ["a"] and len({tuple(t) for t in got.values()}) == 1
