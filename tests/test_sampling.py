import pytest
import torch

from verispec import InvalidRequest, SamplingParams
from verispec.sampling import probabilities, sample


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
