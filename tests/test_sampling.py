import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verispec import InvalidRequest, SamplingParams
from verispec.sampling import greedy_tokens, probabilities, sample


def test_temperature_scales_softmax():
    logits = torch.tensor([1.0, 2.0, 3.0])
    p = probabilities(logits, SamplingParams(temperature=2.0))
    assert torch.allclose(p, torch.softmax(logits / 2, -1))


def test_top_k_keeps_k_most_likely():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0]])
    p = probabilities(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(p, torch.tensor([[0, torch.e / (torch.e + 1), 1 / (torch.e + 1), 0]]).float(), atol=1e-6)


def test_top_p_keeps_smallest_head_reaching_mass():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    p = probabilities(probs.log(), SamplingParams(temperature=1.0, top_p=0.75))
    assert torch.allclose(p, torch.tensor([0.5, 0.3, 0, 0]) / 0.8)
    p = probabilities(probs.log(), SamplingParams(temperature=1.0, top_p=0.8))  # reached exactly by two tokens
    assert torch.allclose(p, torch.tensor([0.5, 0.3, 0, 0]) / 0.8, atol=1e-6)
    p = probabilities(probs.log(), SamplingParams(temperature=1.0, top_p=0.1))  # the top token always stays
    assert torch.allclose(p, torch.tensor([1.0, 0, 0, 0]))


def test_greedy_is_one_hot_and_sample_returns_it():
    logits = torch.tensor([0.1, 0.7, 0.2])
    p = probabilities(logits, SamplingParams())
    assert p.tolist() == [0.0, 1.0, 0.0]
    assert all(sample(p, torch.Generator().manual_seed(s)) == 1 for s in range(20))


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(temperature=-0.5), "temperature must be >= 0"),
        (dict(temperature=float("nan")), "temperature must be a number"),
        (dict(top_p=0.0), "top_p must be in (0, 1]"),
        (dict(top_p=1.5), "top_p must be in (0, 1]"),
        (dict(top_k=-1), "top_k must be a whole number"),
    ],
)
def test_bad_sampling_parameters_are_named(kwargs, words):
    with pytest.raises(InvalidRequest, match=words.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("top_p", [1.7e-158, 5e-324, 1e-45, 1.4e-45, 1e-38, 1e-7])
def test_top_p_at_and_below_float32s_smallest_number_keeps_the_most_likely_token(top_p):
    logits = torch.tensor([[0.5, 2.0, -1.0, 1.9], [3.0, 3.0, 0.0, -2.0]])
    probs = probabilities(logits, SamplingParams(temperature=1.1, top_p=top_p))
    assert torch.isfinite(probs).all() and torch.allclose(probs.sum(-1), torch.ones(2))
    assert probs[0].tolist() == [0.0, 1.0, 0.0, 0.0]
    assert sample(probs[0], torch.Generator().manual_seed(1)) == 1


@pytest.mark.parametrize("temperature", [2.9e-192, 5e-324, 1e-45, 1e-30])
def test_a_tiny_temperature_is_greedy_not_nan(temperature):
    """1e-192 once divided every logit to inf and softmax returned NaN (a 500 from the server, found by the
    schema fuzz run); the limit of T -> 0 is the argmax, with ties shared."""
    logits = torch.tensor([[0.5, 2.0, -1.0, 1.9], [3.0, 3.0, 0.0, -2.0]])
    probs = probabilities(logits, SamplingParams(temperature=temperature))
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0]]


@settings(max_examples=200, deadline=None)
@given(
    logits=st.lists(st.floats(-30, 30, allow_nan=False), min_size=2, max_size=12),
    temperature=st.one_of(st.just(0.0), st.floats(1e-3, 5.0), st.floats(1e-300, 1e-3), st.just(5e-324)),
    top_k=st.integers(0, 14),
    top_p=st.one_of(st.floats(min_value=0.0, max_value=1.0, exclude_min=True), st.just(1.0), st.just(5e-324)),
)
def test_any_accepted_parameters_give_a_valid_distribution(logits, temperature, top_k, top_p):
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    probs = probabilities(torch.tensor([logits]), params)[0]
    assert torch.isfinite(probs).all() and (probs >= 0).all()
    assert abs(float(probs.sum()) - 1.0) < 1e-5
    # the most likely token (one of them on a tie, judged in float32 as the filters see it: the unfiltered
    # distribution at this temperature) always stays
    likelihood = probabilities(torch.tensor([logits]), SamplingParams(temperature=temperature))[0]
    assert probs[likelihood == likelihood.max()].sum() > 0
    assert 0 <= sample(probs, torch.Generator().manual_seed(0)) < len(logits)


def test_sample_follows_the_distribution_and_never_draws_a_zero():
    """Inverse-CDF sampling: frequencies match p (chi-square), ids of probability 0 never come, weights need not
    sum to 1."""
    from scipy.stats import chisquare

    p = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.25, 0.05, 0.0])
    g = torch.Generator().manual_seed(0)
    draws = torch.tensor([sample(p * 3.0, g) for _ in range(20000)])
    counts = torch.bincount(draws, minlength=len(p)).double()
    assert counts[p == 0].sum() == 0
    nonzero = p > 0
    assert chisquare(counts[nonzero].numpy(), (p[nonzero].double() * 20000).numpy()).pvalue > 1e-3
    assert sample(torch.tensor([0.0, 0.0, 1.0]), g) == 2 and sample(torch.tensor([1.0, 0.0]), g) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_greedy_tokens_are_torchs_argmax_first_of_ties_included(dtype):
    logits = torch.randn(6, 1000, generator=torch.Generator().manual_seed(0)).to(dtype)
    logits[2, 10] = logits[2, 500] = logits[2].max() + 1  # a tie: the first index wins, as in torch.argmax
    rows = logits[1:]  # a view, as the engine passes its rows
    assert greedy_tokens(rows) == rows.argmax(dim=-1).tolist()
    assert greedy_tokens(rows)[1] == 10
