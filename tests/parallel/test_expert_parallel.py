"""Mixture-of-Experts models on tensor-parallel ranks: experts sliced on every rank, or held whole by one rank
each (expert parallelism, placed contiguous or round-robin); the single process's greedy tokens and its logits
within 1e-3 either way."""

import pytest
import torch

from kvyard import LLM
from kvyard.errors import ConfigError, InvalidRequestError
from kvyard.models.config import ModelConfig
from kvyard.parallel.comm import current_group
from kvyard.parallel.expert import expert_placement, rank_loads
from kvyard.parallel.tensor import check_tensor_parallel, shard_stream, shard_tensor
from tests.parallel.test_tensor_parallel import GREEDY, LOGIT_ATOL, PROMPTS, _single


def test_placements_share_the_experts_out_and_take_any_count():
    assert expert_placement(8, 2) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert expert_placement(8, 2, "round_robin") == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert expert_placement(8, 3) == [(0, 1, 2), (3, 4, 5), (6, 7)]  # uneven: the first ranks one more
    assert expert_placement(8, 3, "round_robin") == [(0, 3, 6), (1, 4, 7), (2, 5)]
    assert rank_loads((5, 1, 0, 2), [(0, 2), (1, 3)]) == (5, 3)
    with pytest.raises(ConfigError, match="at least as many experts"):
        expert_placement(2, 4)
    with pytest.raises(ConfigError, match="contiguous, round_robin"):
        expert_placement(8, 2, "random")


def _moe_config(**overrides) -> ModelConfig:
    hf = {"model_type": "qwen2_moe", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 12,
          "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 4,
          "num_experts_per_tok": 2, "moe_intermediate_size": 6, "shared_expert_intermediate_size": 10}
    return ModelConfig.from_hf({**hf, **overrides})


def test_experts_are_sliced_or_kept_whole_and_a_rank_reads_only_its_own():
    cfg = _moe_config()
    gate, down = torch.arange(6 * 8).view(6, 8), torch.arange(8 * 6).view(8, 6)
    e = "model.layers.0.mlp.experts.3."
    assert torch.equal(shard_tensor(e + "gate_proj.weight", gate, cfg, 1, 2), gate[3:])
    assert torch.equal(shard_tensor(e + "down_proj.weight", down, cfg, 1, 2), down[:, 3:])
    assert torch.equal(shard_tensor(e + "down_proj.weight", down, cfg, 1, 2, experts=True), down)
    mixtral_w2 = "model.layers.0.block_sparse_moe.experts.0.w2.weight"
    assert torch.equal(shard_tensor(mixtral_w2, down, cfg, 0, 2), down[:, :3])
    shared = torch.arange(10 * 8).view(10, 8)  # the shared expert is sliced with or without expert parallelism
    assert torch.equal(shard_tensor("model.layers.0.mlp.shared_expert.up_proj.weight", shared, cfg, 0, 2,
                                    experts=True), shared[:5])
    tensors = [(f"model.layers.0.mlp.experts.{j}.up_proj.weight", gate) for j in range(4)]
    assert [n for n, _ in shard_stream(tensors, cfg, 1, 2, held_experts=(1, 3))] == [
        tensors[1][0], tensors[3][0]]


def test_what_ranks_cannot_split_is_named():
    with pytest.raises(ConfigError, match=r"expert intermediate size 6.*sizes that do: 1, 2$"):
        check_tensor_parallel(_moe_config(), 3)  # 3 does not divide the heads nor the experts' 6
    with pytest.raises(ConfigError, match=r"3 experts.*sizes that do: 1, 2$"):
        check_tensor_parallel(_moe_config(num_experts=3, num_attention_heads=8, num_key_value_heads=4), 4,
                              experts=True)
    with pytest.raises(ConfigError, match="needs a Mixture-of-Experts model"):
        check_tensor_parallel(ModelConfig.from_hf({"model_type": "llama", "vocab_size": 10, "hidden_size": 8,
                                                   "intermediate_size": 4, "num_hidden_layers": 1,
                                                   "num_attention_heads": 2}), 2, experts=True)
    with pytest.raises(ConfigError, match="not olmoe"):
        check_tensor_parallel(_moe_config(model_type="olmoe"), 2)


def test_expert_parallelism_needs_tensor_parallel_ranks(tiny_checkpoint):
    with pytest.raises(ConfigError, match="set tensor_parallel_size above 1"):
        LLM(str(tiny_checkpoint("mixtral")), dtype="float32", enable_expert_parallel=True)
    with pytest.raises(InvalidRequestError, match="contiguous or round_robin"):
        LLM(str(tiny_checkpoint("mixtral")), dtype="float32", expert_placement="random")


def _ranks_match(path, ranks: int, **parallel) -> LLM:
    """The parallel engine's tokens and logits against the single process's; the engine, still open."""
    want, want_logits, _ = _single(path)
    llm = LLM(str(path), dtype="float32", tensor_parallel_size=ranks, **parallel)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
    for prompt, theirs in zip(PROMPTS, want_logits, strict=True):
        ours = llm.engine.compute_logits(llm.tokenizer(prompt).input_ids)
        assert (ours - theirs).abs().max().item() <= LOGIT_ATOL
    return llm


@pytest.mark.parametrize("arch,placement", [("qwen2_moe", "contiguous"), ("qwen3_moe", "round_robin"),
                                            ("mixtral", "contiguous"), ("qwen2_moe", None), ("mixtral", None)])
def test_moe_families_on_two_ranks(tiny_checkpoint, arch, placement):
    """placement None: every expert sliced over the ranks; else expert parallelism with that map."""
    parallel = {} if placement is None else {"enable_expert_parallel": True, "expert_placement": placement}
    with _ranks_match(tiny_checkpoint(arch), 2, **parallel) as llm:
        model = llm.engine.runner.model
        moe = next(layer.moe for layer in model.layers if layer.moe is not None)
        cfg = llm.engine.model_config
        if placement is None:  # all 4 experts, half of each one's intermediate rows
            assert moe.gate_up.shape == (4, cfg.hidden_size, cfg.moe_intermediate_size)
        else:  # rank 0's 2 experts whole, and every expert's load counted (routing is replicated)
            assert model.expert_placement == expert_placement(4, 2, placement)
            assert moe.gate_up.shape == (2, cfg.hidden_size, 2 * cfg.moe_intermediate_size)
            assert moe.local_index.tolist() == ([0, 1, -1, -1] if placement == "contiguous" else [0, -1, 1, -1])
            assert moe.tokens_per_expert.sum() > 0 and moe.tokens_per_expert.sum() % cfg.num_experts_per_tok == 0
    assert current_group() is None


@pytest.mark.slow  # 26 s in CI; test_moe_families_on_two_ranks keeps expert parallelism against one process there
def test_split_smollm2_moe_on_three_ranks(smollm2_path, tmp_path):
    """SmolLM2's MLPs split into 8 experts, top-2 (`kvyard moe split`), its 9 heads over 3 ranks and its experts
    3, 3 and 2 a rank."""
    from kvyard.cli.main import main

    out = tmp_path / "smollm2-moe8"
    assert main(["moe", "split", "--model", str(smollm2_path), "--experts", "8", "--top-k", "2", "--out", str(out),
                 "--calibration-prompts", "4", "--eval-prompts", "1"]) == 0
    with _ranks_match(out, 3, enable_expert_parallel=True, max_model_len=256) as llm:
        moe = llm.engine.runner.model.layers[0].moe
        assert moe.gate_up.shape[0] == 3 and llm.engine.runner.model.expert_placement[2] == (6, 7)
