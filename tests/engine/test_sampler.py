import pytest
import torch

from kvyard.engine.request import Request
from kvyard.engine.sampler import filter_logits, sample
from kvyard.errors import InvalidRequestError
from kvyard.sampling_params import SamplingParams


def req(prompt=(1, 2, 3), output=(), eos=(0,), **params) -> Request:
    r = Request("r", list(prompt), SamplingParams(**params), eos_token_ids=eos)
    r.token_ids.extend(output)
    return r


def test_greedy_takes_argmax():
    logits = torch.tensor([[0.1, 3.0, 0.2, -1.0], [5.0, 0.0, 0.0, 0.0]])
    assert sample(logits, [req(temperature=0), req(top_k=1)]).token_ids == [1, 0]


def test_top_k_keeps_k_best():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0]])
    probs = filter_logits(logits, [req(top_k=2)])
    assert probs[0, 2:].sum() == 0 and probs[0, :2].sum() == pytest.approx(1.0)


def test_top_p_keeps_smallest_set_reaching_p():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    probs = filter_logits(logits, [req(top_p=0.7)])
    assert probs[0].tolist() == pytest.approx([0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0])


def test_min_p_drops_tokens_below_fraction_of_best():
    logits = torch.tensor([[0.6, 0.3, 0.08, 0.02]]).log()
    probs = filter_logits(logits, [req(min_p=0.1)])
    assert probs[0, 3] == 0 and probs[0, 2] > 0


def test_rows_keep_their_own_parameters():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0]] * 2)
    probs = filter_logits(logits, [req(top_k=1, temperature=1.0), req(temperature=1.0)])
    assert probs[0, 1] == 0 and probs[1, 1] > 0


def test_seed_reproduces_and_distribution_is_followed():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    draws = lambda seed: [sample(logits.clone(), [r]).token_ids[0] for r in [req(seed=seed)] for _ in range(400)]  # noqa: E731
    a, b = draws(7), draws(7)
    assert a == b
    freq = torch.bincount(torch.tensor(a), minlength=4).float() / len(a)
    assert torch.allclose(freq, logits.softmax(-1)[0], atol=0.06)


def test_repetition_penalty_follows_hf_rule():
    logits = torch.tensor([[2.0, -2.0, 2.0, 1.0]])
    r = req(prompt=[0, 1], repetition_penalty=2.0, temperature=0)
    sample(logits, [r])
    assert logits[0].tolist() == [1.0, -4.0, 2.0, 1.0]


def test_presence_and_frequency_penalties_count_output_only():
    logits = torch.zeros(1, 4)
    r = req(prompt=[3], output=[1, 1, 2], presence_penalty=0.5, frequency_penalty=0.25, temperature=0)
    sample(logits, [r])
    assert logits[0].tolist() == [0.0, -1.0, -0.75, 0.0]


def test_min_tokens_bans_eos_and_stop_tokens():
    logits = torch.tensor([[9.0, 0.0, 8.0, 1.0]])
    r = req(eos=(0,), stop_token_ids=[2], min_tokens=2, temperature=0)
    assert sample(logits, [r]).token_ids == [3]


def test_logprobs_are_raw_model_logprobs_with_top_n():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.5]])
    lp = sample(logits.clone(), [req(logprobs=2, temperature=0)]).logprobs[0]
    ref = logits.log_softmax(-1)[0]
    assert lp.token_id == 2 and lp.logprob == pytest.approx(ref[2].item())
    assert list(lp.top) == [2, 1] and lp.top[1] == pytest.approx(ref[1].item())


@pytest.mark.parametrize(
    "field,value",
    [("temperature", -1.0), ("top_p", 0.0), ("top_k", -2), ("max_tokens", 0), ("min_p", 1.5),
     ("logprobs", 99), ("n", 0), ("presence_penalty", 3.0), ("stop", [""]), ("repetition_penalty", 0.0)],
)
def test_bad_parameters_raise_typed_error_naming_the_field(field, value):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**{field: value})
    assert e.value.param == field


def test_fast_argmax_equals_torch_argmax_including_ties():
    from kvyard.engine.sampler import fast_argmax

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 49_153, generator=g)
    logits[3, 100] = logits[3, 40_000] = 99.0  # a tie across chunks: the first index wins
    logits[5, 1023] = logits[5, 1024] = 99.0  # a tie across a chunk boundary
    logits[7, -1] = 99.0  # the columns past the last whole chunk
    logits[9, 5] = logits[9, -1] = 99.0  # a tie between a chunk and those columns
    logits[11, -2] = 99.0
    logits[11, -1] = 99.0
    assert torch.equal(fast_argmax(logits), logits.argmax(-1))
    assert torch.equal(fast_argmax(logits[:, :4096]), logits[:, :4096].argmax(-1))  # whole chunks, rows strided
    assert torch.equal(fast_argmax(logits[:, 1:]), logits[:, 1:].argmax(-1))


def _sorted_reference(logits: torch.Tensor, k: int, p: float) -> torch.Tensor:
    """top-k / top-p by a full sort: keep the first k tokens whose preceding mass is below p."""
    values, order = logits.sort(descending=True)
    probs = values.softmax(-1)
    keep = (torch.arange(len(values)) < (k or len(values))) & (probs.cumsum(-1) - probs < p)
    return torch.full_like(logits, float("-inf")).scatter(0, order, values.masked_fill(~keep, float("-inf")))


@pytest.mark.parametrize("candidates", [256, 4])  # 4: most top-p rows overflow into the full-sort fallback
def test_partial_sort_top_k_top_p_equals_full_sort(monkeypatch, candidates):
    import kvyard.engine.sampler as sampler

    monkeypatch.setattr(sampler, "_NUCLEUS_CANDIDATES", candidates)
    g = torch.Generator().manual_seed(1)
    # Peaked and flat rows; k and p chosen so that neither always decides.
    logits = torch.randn(6, 3000, generator=g) * torch.tensor([[8.0], [8.0], [0.3], [0.3], [2.0], [2.0]])
    top_k, top_p = [0, 20, 0, 500, 3, 0], [0.9, 0.95, 0.5, 0.99, 1.0, 0.3]
    got = sampler.top_k_top_p(logits, top_k, top_p)
    for i in range(6):
        ref = _sorted_reference(logits[i], top_k[i], top_p[i])
        assert torch.equal(got[i].isfinite(), ref.isfinite()), i
        assert torch.equal(got[i][got[i].isfinite()], ref[ref.isfinite()]), i


def test_top_k_alone_keeps_exactly_k_even_when_the_mass_rounds_to_one():
    logits = torch.tensor([[60.0, 1.0, 0.5, 0.0, -1.0]])  # the first token holds all the mass in fp32
    probs = filter_logits(logits, [req(top_k=3, temperature=1.0)])
    assert (probs[0, :3] > 0).tolist() == [True, True, True] and probs[0, 3:].sum() == 0


def test_unseeded_rows_follow_the_distribution_in_one_batch():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]] * 200)
    reqs = [req(temperature=1.0) for _ in range(200)]
    draws = sample(logits.clone(), reqs).token_ids + sample(logits.clone(), reqs).token_ids
    freq = torch.bincount(torch.tensor(draws), minlength=4).float() / len(draws)
    assert torch.allclose(freq, logits[0].softmax(-1), atol=0.06)


def test_seeded_and_unseeded_rows_share_a_batch():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]] * 3)
    alone = sample(logits[:1].clone(), [req(seed=5)]).token_ids[0]
    mixed = sample(logits.clone(), [req(temperature=1.0), req(seed=5), req(temperature=0)]).token_ids
    assert mixed[1] == alone and mixed[2] == 3
