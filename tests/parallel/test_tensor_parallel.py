"""Tensor parallelism: ranks, each a process holding its share of every layer and of the KV cache, exchanging
partial sums through shared memory (or gloo), give the single-process engine's greedy tokens and its logits within 1e-3."""

import multiprocessing

import pytest
import torch

from kvyard import LLM, SamplingParams
from kvyard.errors import ConfigError
from kvyard.models.config import ModelConfig
from kvyard.parallel.comm import current_group
from kvyard.parallel.tensor import check_tensor_parallel, local_config
from tests.parallel.spawn import spawn_ranks
from tests.tiny import make_tiny_checkpoint

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = ["The quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return a + b", "Paged attention"]
LOGIT_ATOL = 1e-3
RANK_TIMEOUT_S = 240


def _rank(rank: int, size: int, port: int, path: str, results: "multiprocessing.Queue") -> None:
    """One rank: join the group, build its share of the engine, answer the prompts (every rank steps the same
    batches, so their collectives line up)."""
    from kvyard.parallel.comm import join_group, leave_group

    try:
        group = join_group(rank, size, f"127.0.0.1:{port}", timeout_s=60)
        llm = LLM(path, dtype="float32", tensor_parallel_size=size, num_threads=1)
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
        prompts = [llm.tokenizer(p).input_ids for p in PROMPTS]
        logits = [llm.engine.compute_logits(p).tolist() for p in prompts]  # plain lists: the process exits
        cache = llm.engine.runner.kv_caches[0]
        results.put((rank, {"tokens": tokens, "logits": logits, "kv_heads": cache.k.shape[1],
                            "all_reduces": group.all_reduces}))
    except BaseException as e:  # the parent reports it
        results.put((rank, {"error": repr(e)}))
    finally:
        leave_group()


def _run_ranks(path, size: int) -> dict[int, dict]:
    got = spawn_ranks(_rank, size, str(path), wait_s=RANK_TIMEOUT_S)
    errors = {r: g["error"] for r, g in got.items() if "error" in g}
    assert not errors, errors
    return got


def _single(path) -> tuple[list[list[int]], list[torch.Tensor], LLM]:
    single = LLM(str(path), dtype="float32")
    want = [o.outputs[0].token_ids for o in single.generate(PROMPTS, GREEDY)]
    return want, [single.engine.compute_logits(single.tokenizer(p).input_ids) for p in PROMPTS], single


@pytest.mark.parametrize("arch,overrides,ranks", [
    ("llama", {}, 2), ("qwen2", {}, 2), ("qwen3", {}, 2),
    ("llama", {"tensor_parallel_comm": "gloo"}, 2),  # TCP, as across hosts, instead of shared memory
    ("llama", {"num_key_value_heads": 1}, 2),  # one KV head for two ranks: replicated on both
    ("llama", {"tie_word_embeddings": True}, 2),  # one vocabulary share serves the embedding and the head
    # three ranks, and a vocabulary they do not divide (401 rows: 134, 134, 133)
    ("llama", {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3, "intermediate_size": 96,
               "vocab_size": 401}, 3)])
def test_ranks_give_the_single_process_tokens(tmp_path, arch, overrides, ranks):
    """LLM(tensor_parallel_size=N) starts ranks 1..N-1 itself and drives them, step by step."""
    comm = overrides.pop("tensor_parallel_comm", "shm")
    path = make_tiny_checkpoint(tmp_path / arch, arch, **overrides)
    want, want_logits, single = _single(path)
    with LLM(str(path), dtype="float32", tensor_parallel_size=ranks, tensor_parallel_comm=comm) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
        for prompt, theirs in zip(PROMPTS, want_logits, strict=True):
            ours = llm.engine.compute_logits(llm.tokenizer(prompt).input_ids)
            assert (ours - theirs).abs().max().item() <= LOGIT_ATOL
        cfg = single.engine.model_config
        # rank 0 holds its share of the KV heads (a whole one where there are fewer heads than ranks)
        assert llm.engine.runner.kv_caches[0].k.shape[1] == max(1, cfg.num_kv_heads // ranks)
        model = llm.engine.runner.model
        assert model.embed.shape[0] == model.lm_head.shape[0] == -(-cfg.vocab_size // ranks)  # its vocabulary share
        # a step's partial sums: the embedding's, then attention's and the MLP's in each layer
        group = current_group()
        assert type(group).__name__ == {"shm": "SharedMemoryGroup", "gloo": "GlooGroup"}[comm]
        assert group.all_reduces >= (2 * cfg.num_layers + 1) * len(PROMPTS)
        assert group.gathers >= len(PROMPTS)  # the logits' shares
    assert current_group() is None  # closing the engine stopped rank 1 and left the group


def test_ranks_launched_from_outside_step_together(tmp_path):
    """Every rank of a group joined by its launcher runs the same engine on the same inputs."""
    path = make_tiny_checkpoint(tmp_path / "llama", "llama")
    want, want_logits, _ = _single(path)
    got = _run_ranks(path, 2)
    for rank in (0, 1):
        assert got[rank]["tokens"] == want
        for ours, theirs in zip(got[rank]["logits"], want_logits, strict=True):
            assert (torch.tensor(ours) - theirs).abs().max().item() <= LOGIT_ATOL


def stream_killing_a_rank(llm: LLM, which: int = 0):
    """Stream PROMPTS[0], killing the engine's `which`th other process after 3 tokens: (the final output, it)."""
    before = llm.engine._workers.processes[which]
    outs = []
    for out in llm.stream(PROMPTS[0], GREEDY):
        outs.append(out)
        if len(outs) == 3:
            before.kill()
            before.join(10)
    return outs[-1].outputs[0], before


def test_a_rank_killed_mid_stream_ends_that_request_and_the_group_restarts(tiny_checkpoint):
    """The stream gets an error (its tokens so far were right), the other ranks restart as a gang, and the next
    requests get the single process's tokens again."""
    path = tiny_checkpoint("llama")
    want, _, _ = _single(path)
    with LLM(str(path), dtype="float32", tensor_parallel_size=2) as llm:
        final, before = stream_killing_a_rank(llm)
        assert final.finish_reason == "error"
        assert 3 <= len(final.token_ids) < len(want[0]) and final.token_ids == want[0][: len(final.token_ids)]
        assert llm.engine.stats["rank_restarts"] == 1
        after = llm.engine._workers.processes[0]
        assert after.pid != before.pid and after.is_alive()
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
    assert current_group() is None


def test_sizes_that_do_not_divide_the_model_name_the_ones_that_do():
    smollm2 = ModelConfig.from_hf({"model_type": "llama", "vocab_size": 49152, "hidden_size": 576,
                                   "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                                   "num_key_value_heads": 3})
    with pytest.raises(ConfigError, match=r"9 attention heads, 3 KV heads.*sizes that do: 1, 3$"):
        check_tensor_parallel(smollm2, 2)
    share = local_config(smollm2, 3)
    assert (share.num_heads, share.num_kv_heads, share.intermediate_size) == (3, 1, 512)


def test_what_does_not_work_with_ranks_yet_is_refused_by_name(tiny_checkpoint):
    with pytest.raises(ConfigError, match="offload tiers"):
        LLM(str(tiny_checkpoint("llama")), dtype="float32", tensor_parallel_size=2, kv_offload_host_memory="1MiB")
    assert current_group() is None


def test_a_rank_holds_only_its_slice_of_the_weights():
    from kvyard.parallel.tensor import shard_tensor

    cfg = ModelConfig.from_hf({"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 6,
                               "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 1,
                               "head_dim": 2})
    q = torch.arange(8 * 8).view(8, 8)
    k = torch.arange(2 * 8).view(2, 8)
    down = torch.arange(8 * 6).view(8, 6)
    name = "model.layers.0."
    assert torch.equal(shard_tensor(name + "self_attn.q_proj.weight", q, cfg, 1, 2), q[4:])
    assert torch.equal(shard_tensor(name + "self_attn.k_proj.weight", k, cfg, 1, 2), k)  # the one KV head, whole
    assert torch.equal(shard_tensor(name + "mlp.down_proj.weight", down, cfg, 0, 2), down[:, :3])
    embed = torch.arange(10 * 8).view(10, 8)
    assert torch.equal(shard_tensor("model.embed_tokens.weight", embed, cfg, 1, 2), embed[5:])
    assert torch.equal(shard_tensor("lm_head.weight", embed, cfg, 2, 3), embed[7:])  # 10 rows: 4, 3, 3
    assert torch.equal(shard_tensor("model.norm.weight", embed[0], cfg, 1, 2), embed[0])  # whole on each rank


def _real_model_ranks_match(path, ranks: int) -> None:
    prompts = PROMPTS[:2]
    with LLM(str(path), dtype="float32", max_model_len=256) as single:
        want = [o.outputs[0].token_ids for o in single.generate(prompts, GREEDY)]
        want_logits = [single.engine.compute_logits(single.tokenizer(p).input_ids) for p in prompts]
    with LLM(str(path), dtype="float32", max_model_len=256, tensor_parallel_size=ranks) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == want
        for prompt, theirs in zip(prompts, want_logits, strict=True):
            ours = llm.engine.compute_logits(llm.tokenizer(prompt).input_ids)
            assert (ours - theirs).abs().max().item() <= LOGIT_ATOL


@pytest.mark.slow  # 39 s; the tiny models' three-rank cases above stay in CI
def test_smollm2_on_three_ranks(smollm2_path):
    """9 heads and 3 KV heads: one KV head, three query heads and a third of the vocabulary a rank."""
    _real_model_ranks_match(smollm2_path, 3)


@pytest.mark.slow
def test_qwen25_coder_on_two_ranks():
    """14 heads and 2 KV heads; fetches the 491 MB checkpoint."""
    from kvyard.loader.registry import resolve_model

    _real_model_ranks_match(resolve_model("qwen2.5-coder-0.5b"), 2)
