import pytest

from kvyard import LLM, SamplingParams
from kvyard.config import OFFLINE_TOKEN_BUDGET
from kvyard.errors import InvalidRequestError, PromptTooLongError, UnsupportedArchitectureError
from tests.tiny import make_tiny_checkpoint

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(str(tiny_checkpoint("llama")), dtype="float32", max_num_batched_tokens=32)


def test_bad_requests_raise_and_engine_keeps_serving(llm):
    eng = llm.engine
    good = eng.add_request("The quick brown fox", GREEDY)
    with pytest.raises(InvalidRequestError):
        eng.add_request("", GREEDY)
    with pytest.raises(PromptTooLongError):
        eng.add_request([5] * eng.max_model_len, GREEDY)
    with pytest.raises(InvalidRequestError):
        eng.add_request([10**9], GREEDY)
    mutated = SamplingParams()
    mutated.temperature = -1.0  # changed after construction: add_request validates again
    with pytest.raises(InvalidRequestError):
        eng.add_request("hi", mutated)
    finished = {}
    while eng.has_unfinished_requests():
        finished.update({o.request_id: o for o in eng.step() if o.finished})
    assert list(finished) == [good]
    assert len(finished[good].outputs[0].token_ids) == 12


def test_unknown_architecture_is_a_typed_error(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "m", "llama")
    cfg = (path / "config.json").read_text().replace('"model_type": "llama"', '"model_type": "gpt2"')
    (path / "config.json").write_text(cfg)
    with pytest.raises(UnsupportedArchitectureError, match="gpt2"):
        LLM(str(path))


def test_stream_deltas_add_up_to_final_text(llm):
    pieces, ids = [], []
    for out in llm.stream("Paged attention", GREEDY):
        pieces.append(out.outputs[0].delta_text)
        ids.extend(out.outputs[0].delta_token_ids)
    final = out.outputs[0]
    assert out.finished and "".join(pieces) == final.text and ids == final.token_ids
    # A random model emits stray bytes; a trailing incomplete character is held back, never emitted broken.
    assert llm.tokenizer.decode(final.token_ids, skip_special_tokens=True).removesuffix("\ufffd") == final.text


def test_stop_string_truncates_and_is_reported(llm):
    full = llm.generate("The quick", GREEDY)[0].outputs[0].text
    stop = full[3:6]
    assert stop and stop in full
    out = llm.generate("The quick", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop]))
    o = out[0].outputs[0]
    assert o.finish_reason == "stop" and o.stop_reason == stop
    assert o.text == full[: full.index(stop)]


def test_stop_token_ids_and_max_tokens(llm):
    first = llm.generate("The quick", GREEDY)[0].outputs[0].token_ids
    o = llm.generate("The quick", SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[first[2]]))[0]
    assert o.outputs[0].token_ids == first[:3] and o.outputs[0].stop_reason == first[2]
    o = llm.generate("The quick", SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
    assert len(o.outputs[0].token_ids) == 5 and o.outputs[0].finish_reason == "length"


def test_seeded_sampling_is_reproducible_in_any_batch(llm):
    p = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = llm.generate("The quick", p)[0].outputs[0].token_ids
    crowd = llm.generate(["def add", "The quick", "x y z"], [GREEDY, p, SamplingParams(max_tokens=20, seed=9)])
    assert crowd[1].outputs[0].token_ids == alone


def test_n_returns_distinct_samples(llm):
    out = llm.generate("The quick", SamplingParams(max_tokens=10, n=3, seed=5, ignore_eos=True))[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1


def test_abort_frees_blocks_at_once(llm):
    eng = llm.engine
    rid = eng.add_request("The quick brown fox", SamplingParams(max_tokens=50, ignore_eos=True))
    eng.step()
    assert eng.blocks.num_free_blocks < eng.blocks.num_blocks
    assert eng.abort_request(rid)
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks
    outs = eng.step()
    assert outs[0].finished and outs[0].outputs[0].finish_reason == "abort"
    assert not eng.has_unfinished_requests()


def test_generation_stops_at_context_limit(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint("llama")), dtype="float32", max_model_len=20)
    out = llm.generate([5] * 15, SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].finish_reason == "length"


def test_logprobs_returned_per_token(llm):
    o = llm.generate("The quick", SamplingParams(max_tokens=4, temperature=0, logprobs=3, ignore_eos=True))[0]
    lps = o.outputs[0].logprobs
    assert len(lps) == 4 and all(len(lp.top) == 3 for lp in lps)
    # greedy: the sampled token is the most likely one
    assert all(lp.token_id == next(iter(lp.top)) for lp in lps)


def test_stop_token_ids_outside_vocabulary_are_refused(llm):
    with pytest.raises(InvalidRequestError) as e:
        llm.engine.add_request("hi", SamplingParams(stop_token_ids=[10**6], min_tokens=1))
    assert e.value.param == "stop_token_ids"


def test_lone_prompt_longer_than_the_token_budget(tiny_checkpoint):
    # Its first steps sample nothing (no row of logits): chunked prefill must carry on regardless.
    path = str(tiny_checkpoint("llama"))
    chunked = LLM(path, dtype="float32", max_num_batched_tokens=8)
    whole = LLM(path, dtype="float32", enable_chunked_prefill=False)
    prompt = "Paged attention keeps the KV cache in fixed-size blocks. " * 2
    a, b = chunked.generate(prompt, GREEDY)[0].outputs[0], whole.generate(prompt, GREEDY)[0].outputs[0]
    assert a.finish_reason == "length" and a.token_ids == b.token_ids


def test_offline_llm_takes_the_offline_token_budget(tiny_checkpoint):
    """The LLM class favours throughput (vLLM's offline default); an explicit budget always wins."""
    path = str(tiny_checkpoint("llama"))
    assert LLM(path, dtype="float32").engine.scheduler.token_budget == OFFLINE_TOKEN_BUDGET
    assert LLM(path, dtype="float32", max_num_batched_tokens=32).engine.scheduler.token_budget == 32
