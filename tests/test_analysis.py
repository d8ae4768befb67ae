"""The acceptance arithmetic against hand-computed values and against Monte-Carlo runs of the real
acceptance rule."""

import pytest
import torch

from verispec import analysis
from verispec.verify import verify

P5 = torch.tensor([0.50, 0.20, 0.15, 0.10, 0.05])
Q5 = torch.tensor([0.38, 0.25, 0.20, 0.10, 0.07])


def test_beta_of_the_five_word_example():
    assert analysis.beta(P5, Q5).item() == pytest.approx(0.88)
    assert analysis.total_variation(P5, Q5).item() == pytest.approx(0.12)
    assert analysis.beta(P5, P5).item() == pytest.approx(1.0)


def test_expected_accepted_tokens_by_hand():
    # 0.88 + 0.88*0.96 + 0.88*0.96*0.65 = 0.88 + 0.8448 + 0.54912
    assert analysis.expected_accepted([0.88, 0.96, 0.65]) == pytest.approx(2.27392)
    assert analysis.expected_tokens([0.88, 0.96, 0.65]) == pytest.approx(3.27392)
    assert analysis.expected_tokens([]) == 1.0


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.8, 1.0])
@pytest.mark.parametrize("k", [1, 4, 9])
def test_geometric_is_the_constant_beta_case(alpha, k):
    assert analysis.expected_tokens_geometric(alpha, k) == pytest.approx(analysis.expected_tokens([alpha] * k))


def test_probabilities_outside_unit_interval_are_rejected():
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        analysis.expected_tokens([0.5, 1.2])


def test_speedup_by_hand():
    # E(2) = 1 + 0.8 + 0.64 = 2.44; cost = 2 * 0.1 + (1 + 0.1 * 2) = 1.4
    r = lambda j: 1 + 0.1 * j  # noqa: E731
    assert analysis.speedup([0.8], 2, 0.1, r) == pytest.approx(2.44 / 1.4)
    assert analysis.speedup([0.8], 0, 0.1, r) == pytest.approx(1.0)


def test_optimal_k_balances_acceptance_against_cost():
    # flat verify cost and free drafts: longer is always better
    assert analysis.optimal_k([0.9], 0.0, lambda j: 1.0, range(1, 9))[0] == 8
    # expensive drafts: k=1 gives 1.5/1.5 = 1, k=2 gives 1.75/2.0 -> best is 1
    k, s = analysis.optimal_k([0.5], 0.5, lambda j: 1.0, range(1, 5))
    assert (k, s) == (1, pytest.approx(1.0))
    # a hand case with an interior optimum: beta 0.8, c 0.05, r(j) = 1 + 0.05 j
    r = lambda j: 1 + 0.05 * j  # noqa: E731
    values = {k: analysis.speedup([0.8], k, 0.05, r) for k in range(1, 17)}
    assert analysis.optimal_k([0.8], 0.05, r)[0] == max(values, key=values.get) == 6


def test_step_prediction_equals_formula_when_every_step_drafts_k():
    steps = [(4, 0), (4, 4), (4, 2), (4, 1), (4, 4), (4, 3)]
    betas = analysis.position_betas(steps, 4)
    # P(a>=1)=5/6, P(a>=2|a>=1)=4/5, P(a>=3|a>=2)=3/4, P(a>=4|a>=3)=2/3
    assert betas == pytest.approx([5 / 6, 4 / 5, 3 / 4, 2 / 3])
    r = lambda j: 1 + 0.2 * j  # noqa: E731
    for k in range(1, 5):
        tokens, speed = analysis.step_speedup(steps, k, 0.01, r)
        assert tokens == pytest.approx(analysis.expected_tokens(betas[:k]))
        assert speed == pytest.approx(analysis.speedup(betas, k, 0.01, r))


def test_step_prediction_charges_only_what_was_drafted():
    # one step drafted nothing: it costs r(0) = 1 and commits one token
    tokens, speed = analysis.step_speedup([(0, 0), (2, 2)], 2, 0.0, lambda j: 1 + j)
    assert tokens == pytest.approx((1 + 3) / 2)
    assert speed == pytest.approx(4 / (1 + 3))


def test_interpolate_and_percentile():
    f = analysis.interpolate({0: 1.0, 2: 2.0, 4: 2.0})
    assert [f(0), f(1), f(3), f(9)] == pytest.approx([1.0, 1.5, 2.0, 2.0])
    assert analysis.percentile([1, 2, 3, 4], 50) == pytest.approx(2.5)
    assert analysis.percentile([], 50) is None


def _random_dist(gen, vocab):
    return torch.softmax(2 * torch.randn(vocab, generator=gen), -1)


def test_monte_carlo_acceptance_rate_equals_beta():
    """Run the real acceptance rule on draws from q: the acceptance frequency must match beta."""
    gen = torch.Generator().manual_seed(0)
    p, q = _random_dist(gen, 6), _random_dist(gen, 6)
    b = analysis.beta(p, q).item()
    n = 20000
    xs = torch.multinomial(q, n, replacement=True, generator=gen)
    accepted = sum(verify(xs[i: i + 1], q[None], torch.stack([p, p]), gen).num_accepted for i in range(n))
    sigma = (b * (1 - b) / n) ** 0.5
    assert abs(accepted / n - b) < 5 * sigma


def test_monte_carlo_tokens_per_step_equal_expected_tokens():
    """Three positions with different (p, q): tokens committed per verify step average to E(3)."""
    gen = torch.Generator().manual_seed(1)
    ps = [_random_dist(gen, 5) for _ in range(4)]
    qs = [_random_dist(gen, 5) for _ in range(3)]
    betas = [analysis.beta(p, q).item() for p, q in zip(ps, qs)]
    p, q = torch.stack(ps), torch.stack(qs)
    n = 8000
    total = 0
    for _ in range(n):
        x = torch.stack([torch.multinomial(qi, 1, generator=gen)[0] for qi in qs])
        total += verify(x, q, p, gen).num_accepted + 1
    mean = total / n
    assert abs(mean - analysis.expected_tokens(betas)) < 0.04, (mean, betas)


def test_replay_splits_accepted_runs_at_smaller_k():
    # a run of 4 accepted + bonus at k=4, replayed at k=1: steps commit 2, 2, 1 and each drafts one token
    tokens, speed = analysis.replay_speedup([(4, 4)], 1, 0.0, lambda j: 1 + j)
    assert tokens == pytest.approx(5 / 3) and speed == pytest.approx(5 / 6)
    # at the run's own k (or larger) replay and capping agree
    steps = [(4, 2), (0, 0), (4, 4), (3, 0)]
    r = lambda j: 1 + 0.3 * j  # noqa: E731
    for k in (4, 8):
        assert analysis.replay_speedup(steps, k, 0.01, r) == pytest.approx(analysis.step_speedup(steps, k, 0.01, r))
    # by hand at k=2: (4,2) one step, 3 tokens, r(2); (0,0) 1 token, r(0); (4,4) steps of 3 then 2 tokens
    # drafting 2 then 1, r(2) + r(1); (3,0) 1 token, r(2): 10 tokens in 5 steps costing 7.1
    assert analysis.replay_speedup(steps, 2, 0.0, r) == pytest.approx((10 / 5, 10 / 7.1))


def test_per_position_expectation_equals_capped_steps_for_any_draft_lengths():
    steps = [(0, 0), (3, 1), (8, 8), (5, 0), (2, 2), (8, 3)]
    betas = analysis.position_betas(steps, 8)
    for k in range(1, 9):
        assert analysis.expected_tokens(betas[:k]) == pytest.approx(analysis.step_speedup(steps, k, 0.0, lambda j: 1)[0])
