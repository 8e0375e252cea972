"""Pipeline parallelism: stages, each a process holding a contiguous share of the layers and of their KV cache,
passing the hidden states on, give the single-process engine's greedy tokens and its logits within 1e-3."""

import pytest

from kvyard import LLM, SamplingParams
from kvyard.errors import ConfigError
from kvyard.parallel.pipeline import stage_layers
from tests.parallel.test_tensor_parallel import GREEDY, LOGIT_ATOL, PROMPTS, _single, stream_killing_a_rank
from tests.tiny import make_tiny_checkpoint


def test_stages_take_contiguous_near_equal_shares():
    assert [list(stage_layers(5, s, 2)) for s in range(2)] == [[0, 1, 2], [3, 4]]
    assert [list(stage_layers(4, s, 3)) for s in range(3)] == [[0, 1], [2], [3]]
    assert [list(stage_layers(30, s, 1)) for s in range(1)] == [list(range(30))]


@pytest.mark.parametrize("arch,overrides,stages", [
    ("llama", {}, 2), ("qwen2", {}, 2), ("qwen3", {}, 2),
    ("llama", {"tie_word_embeddings": True}, 2),  # the last stage's head is the embedding stage 0 also holds
    ("llama", {"num_layers": 4}, 3),  # layers 0-1, 2, 3
])
def test_stages_give_the_single_process_tokens(tmp_path, arch, overrides, stages):
    path = make_tiny_checkpoint(tmp_path / arch, arch, **overrides)
    want, want_logits, single = _single(path)
    with LLM(str(path), dtype="float32", pipeline_parallel_size=stages) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
        for prompt, theirs in zip(PROMPTS, want_logits, strict=True):
            ours = llm.engine.compute_logits(llm.tokenizer(prompt).input_ids)
            assert (ours - theirs).abs().max().item() <= LOGIT_ATOL
        model = llm.engine.runner.model  # stage 0's: the embedding and its layers, no head
        layers = single.engine.model_config.num_layers
        assert len(model.layers) == len(llm.engine.runner.kv_caches) == len(stage_layers(layers, 0, stages))
        assert model.final_norm is None and (model.lm_head is None)
        assert len(llm.engine._workers.processes) == stages - 1


@pytest.mark.parametrize("arch,parallel", [
    ("llama", {}),  # the other families, 20 s each, in -m slow: tp and ep cover them on their own
    pytest.param("qwen2", {}, marks=pytest.mark.slow), pytest.param("qwen3", {}, marks=pytest.mark.slow),
    pytest.param("mixtral", {"enable_expert_parallel": True}, marks=pytest.mark.slow),  # a stage's experts on 2 ranks
])
def test_stages_of_tensor_parallel_ranks_give_the_single_process_tokens(tmp_path, arch, parallel):
    """tp=2 x pp=2: four processes; each stage a group of its own, its rank 0 passing the steps to its peer."""
    path = make_tiny_checkpoint(tmp_path / arch, arch)
    want, want_logits, single = _single(path)
    with LLM(str(path), dtype="float32", tensor_parallel_size=2, pipeline_parallel_size=2, **parallel) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
        for prompt, theirs in zip(PROMPTS, want_logits, strict=True):
            ours = llm.engine.compute_logits(llm.tokenizer(prompt).input_ids)
            assert (ours - theirs).abs().max().item() <= LOGIT_ATOL
        cfg = single.engine.model_config
        model, caches = llm.engine.runner.model, llm.engine.runner.kv_caches
        assert len(model.layers) == 1 and model.lm_head is None  # stage 0: layer 0 and the embedding...
        assert caches[0].k.shape[1] == cfg.num_kv_heads // 2  # ...its rank's half of the KV heads...
        assert model.embed.shape[0] == -(-cfg.vocab_size // 2)  # ...and half the vocabulary
        # rank 1 of stage 0, then stage 1 (the rank 0 of its own group, which started its rank 1 itself)
        assert [p.name for p in llm.engine._workers.processes] == ["kvyard-rank-1", "kvyard-stage-1"]
        assert llm.engine.stats["overlapped_steps"] > 0


@pytest.mark.slow  # 27 s in CI; test_a_stage_killed_mid_stream_ends_that_request_and_the_stages_restart stays
def test_a_killed_stage_restarts_with_its_ranks(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    want, _, _ = _single(path)
    with LLM(str(path), dtype="float32", tensor_parallel_size=2, pipeline_parallel_size=2) as llm:
        final, _ = stream_killing_a_rank(llm, which=1)  # stage 1, whose own rank 1 then goes too
        assert final.finish_reason == "error" and llm.engine.stats["rank_restarts"] == 1
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == want


@pytest.mark.parametrize("overlap", [True, False])
def test_stages_work_on_two_batches_at_once(tiny_checkpoint, overlap):
    """With overlap, the requests are shared out over two batches, one in each stage: the same tokens."""
    path = tiny_checkpoint("llama")
    want, _, _ = _single(path)
    with LLM(str(path), dtype="float32", pipeline_parallel_size=2, pipeline_overlap=overlap) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
        overlapped = llm.engine.stats["overlapped_steps"]
        # 3 requests: batches of 2 and 1, each launched while the other is in the pipeline, every token
        assert overlapped >= len(want[0]) if overlap else overlapped == 0


def test_batches_in_flight_larger_than_a_pipe_do_not_deadlock(tiny_checkpoint):
    """Prompt logprobs of long prompts: each batch's logits and hidden states are far more than a pipe holds, so
    stage 0 must not block writing one batch while the last stage blocks writing the other's logits."""
    path = tiny_checkpoint("llama")
    prompts = [" ".join(["paged attention"] * 38), " ".join(["the quick brown fox"] * 75)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    with LLM(str(path), dtype="float32") as single:
        want = [(o.outputs[0].token_ids, o.prompt_logprobs) for o in single.generate(prompts, params)]
    with LLM(str(path), dtype="float32", pipeline_parallel_size=2) as llm:
        got = [(o.outputs[0].token_ids, o.prompt_logprobs) for o in llm.generate(prompts, params)]
        assert llm.engine.stats["overlapped_steps"] > 0
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want, strict=True):
        assert tokens == want_tokens and len(logprobs) == len(want_logprobs) > 256


def test_a_stage_killed_mid_stream_ends_that_request_and_the_stages_restart(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    want, _, _ = _single(path)
    with LLM(str(path), dtype="float32", pipeline_parallel_size=2) as llm:
        final, before = stream_killing_a_rank(llm)
        assert final.finish_reason == "error"
        assert llm.engine.stats["rank_restarts"] == 1
        assert llm.engine._workers.processes[0].pid != before.pid
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == want


def test_more_stages_than_layers_is_refused(tiny_checkpoint):
    with pytest.raises(ConfigError, match="between 1 and the model's 2 layers"):
        LLM(str(tiny_checkpoint("llama")), dtype="float32", pipeline_parallel_size=3)
