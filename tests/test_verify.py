"""The acceptance rule on hand-built tensors: exact cases, then its distribution by Monte Carlo."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from verispec.sampling import SamplingParams, probabilities
from verispec.verify import verify, verify_typical


def onehot(i, v=5):
    return torch.nn.functional.one_hot(torch.tensor(i), v).float()


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_accept_all_then_bonus():
    q = torch.tensor([[0.2, 0.8, 0, 0, 0], [0.1, 0.1, 0.8, 0, 0]])
    # p >= q on both drafted tokens: min(1, p/q) = 1, so both are always accepted
    p = torch.stack([torch.tensor([0.1, 0.9, 0, 0, 0]), torch.tensor([0, 0, 1.0, 0, 0]), onehot(4)])
    for seed in range(20):
        v = verify(torch.tensor([1, 2]), q, p, gen(seed))
        assert (v.num_accepted, v.next_token) == (2, 4)  # bonus drawn from p_3 = onehot(4)


def test_reject_at_second_position_with_correction_from_residual():
    x = torch.tensor([1, 3])
    q = torch.tensor([[0, 1.0, 0, 0, 0], [0, 0, 0.5, 0.5, 0]])
    # position 2: p(x=3) = 0 -> always rejected; max(p - q, 0) = (0, 0, 0, 0, 0.5) -> correction is token 4
    p = torch.stack([onehot(1), torch.tensor([0, 0, 0.5, 0, 0.5]), onehot(0)])
    for seed in range(20):
        v = verify(x, q, p, gen(seed))
        assert (v.num_accepted, v.next_token) == (1, 4)


def test_reject_first_position():
    x = torch.tensor([0, 1, 2])
    q = torch.full((3, 5), 0.2)
    p = torch.stack([onehot(3), onehot(1), onehot(2), onehot(4)])
    v = verify(x, q, p, gen())
    assert (v.num_accepted, v.next_token) == (0, 3)


def test_one_hot_drafts_accept_with_probability_p_and_remove_x_from_residual():
    x = torch.tensor([2, 0])
    p = torch.stack([onehot(2), torch.tensor([0, 0.5, 0.5, 0, 0]), onehot(1)])
    # p_2(0) = 0: rejected; residual = p_2 with token 0 removed = (0, .5, .5, 0, 0)
    outcomes = {verify(x, None, p, gen(s)).next_token for s in range(200)}
    assert outcomes == {1, 2}
    assert all(verify(x, None, p, gen(s)).num_accepted == 1 for s in range(20))
    # p(x) = 1 everywhere: all accepted, bonus from the last row
    v = verify(torch.tensor([2]), None, torch.stack([onehot(2), onehot(3)]), gen())
    assert (v.num_accepted, v.next_token) == (1, 3)


def test_no_draft_samples_from_p():
    v = verify(torch.tensor([], dtype=torch.long), None, onehot(3).unsqueeze(0), gen())
    assert (v.num_accepted, v.next_token) == (0, 3)


def test_greedy_is_argmax_agreement():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0, 0], [5.0, 1, 1, 1, 1], [0, 0, 0, 0, 9.0]])
    p = probabilities(logits, SamplingParams(temperature=0))
    assert torch.equal(p.argmax(-1), torch.tensor([1, 0, 4])) and torch.equal(p.sum(-1), torch.ones(3))
    # draft agrees at position 1, disagrees at 2 -> 1 accepted, correction = argmax of row 2
    v = verify(torch.tensor([1, 3]), None, p, gen())
    assert (v.num_accepted, v.next_token) == (1, 0)
    # with a model draft's q (any distribution) the greedy outcome is the same
    q = torch.softmax(torch.randn(2, 5), -1)
    for seed in range(10):
        assert verify(torch.tensor([1, 3]), q, p, gen(seed)) == v
    v = verify(torch.tensor([1, 0]), None, p, gen())
    assert (v.num_accepted, v.next_token) == (2, 4)


def test_typical_acceptance_thresholds():
    p = torch.stack([torch.tensor([0.5, 0.3, 0.2, 0, 0]), torch.tensor([0.96, 0.01, 0.01, 0.01, 0.01]), onehot(0)])
    # row 1: threshold min(0.09, 0.3 exp(-H)) ~ 0.09 -> 0.3 accepted;
    # row 2: H small, threshold 0.09 -> 0.01 rejected, correction sampled from p_2
    v = verify_typical(torch.tensor([1, 1]), p, gen())
    assert v.num_accepted == 1
    # typical accepts a token the strict rule would only accept 30% of the time with a one-hot draft
    accepted = sum(verify_typical(torch.tensor([1]), p[[0, 2]], gen(s)).num_accepted for s in range(50))
    assert accepted == 50


def test_typical_equals_greedy_at_temperature_zero():
    logits = torch.randn(4, 7, generator=gen(3))
    p = probabilities(logits, SamplingParams(temperature=0))
    for draft in ([int(p[0].argmax()), 0, 1], [int(p[0].argmax()), int(p[1].argmax()), int(p[2].argmax())]):
        x = torch.tensor(draft)
        assert verify_typical(x, p, gen()) == verify(x, None, p, gen())


def _first_token_distribution(p, q, x_sampler, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(p.shape[1])
    for _ in range(n):
        x = x_sampler(g)
        v = verify(x, q, p, g)
        first = int(x[0]) if v.num_accepted > 0 else v.next_token
        counts[first] += 1
    return counts


def test_first_token_follows_p_exactly_for_model_drafts():
    g = gen(11)
    v, k = 6, 3
    p = torch.softmax(2 * torch.randn(k + 1, v, generator=g), -1)
    q = torch.softmax(2 * torch.randn(k, v, generator=g), -1)
    n = 20000

    def sample_draft(gg):
        return torch.multinomial(q, 1, generator=gg).squeeze(1)

    counts = _first_token_distribution(p, q, sample_draft, n)
    assert chisquare(counts.numpy(), (n * p[0]).numpy()).pvalue > 1e-3


def test_first_token_follows_p_exactly_for_one_hot_drafts():
    g = gen(12)
    p = torch.softmax(2 * torch.randn(3, 6, generator=g), -1)
    x = torch.tensor([4, 1])
    n = 20000
    counts = _first_token_distribution(p, None, lambda gg: x, n)
    assert chisquare(counts.numpy(), (n * p[0]).numpy()).pvalue > 1e-3


def test_acceptance_probability_is_one_minus_total_variation():
    g = gen(13)
    p = torch.softmax(torch.randn(2, 8, generator=g), -1)
    q = torch.softmax(torch.randn(1, 8, generator=g), -1)
    beta = float(torch.minimum(p[0], q[0]).sum())
    n = 20000
    gg = gen(5)
    accepted = 0
    for _ in range(n):
        x = torch.multinomial(q[0], 1, generator=gg)
        accepted += verify(x, q, p, gg).num_accepted
    se = (beta * (1 - beta) / n) ** 0.5
    assert abs(accepted / n - beta) < 5 * se


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.integers(2, 9), st.integers(0, 10_000), st.booleans())
def test_verdict_is_always_a_possible_outcome(k, v, seed, one_hot):
    g = gen(seed)
    p = torch.softmax(3 * torch.randn(k + 1, v, generator=g), -1)
    p[p < 0.05] = 0  # sparse target rows
    p[:, 0] += 1e-3
    p = p / p.sum(-1, keepdim=True)
    q = None if one_hot else torch.softmax(torch.randn(k, v, generator=g), -1)
    x = torch.randint(0, v, (k,), generator=g) if one_hot else torch.multinomial(q, 1, generator=g).squeeze(1)
    verdict = verify(x, q, p, g)
    n = verdict.num_accepted
    assert 0 <= n <= k
    assert p[n, verdict.next_token] > 0  # the correction/bonus is always a token the target can produce
    if n < k and q is None:
        assert verdict.next_token != int(x[n])  # the rejected draft token is never the correction
