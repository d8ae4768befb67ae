"""Acceptance arithmetic for speculative decoding, in the papers' notation. Pure functions, no models.

p is the target's next-token distribution, q the drafter's. With strict rejection sampling a draft token
is accepted with probability beta = sum_x min(p(x), q(x)) = 1 - TV(p, q) (Leviathan et al. 2023, Chen et
al. 2023). If position i of a draft is accepted with probability beta_i given that positions < i were,
one verify step commits

    E(k) = 1 + beta_1 + beta_1 beta_2 + ... + beta_1 ... beta_k          (the 1 is the bonus/correction)

tokens on average; with a constant beta = a this is the geometric (1 - a^(k+1)) / (1 - a). A step costs
k draft steps of relative cost c (one draft step / one plain decoding step) plus one verify pass over k+1
tokens of relative cost r(k) = verify_cost(k) / verify_cost(0) (verify_cost(j) = time of a target pass
that verifies j draft tokens, i.e. feeds j+1 tokens; verify_cost(0) is a plain decoding step), so

    speedup(k) = E(k) / (k c + r(k)).

On a GPU r(k) ~ 1 for small k; on a CPU it is not, which is why the cost curve is measured, not assumed.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch


def beta(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Acceptance probability sum_x min(p(x), q(x)) over the last dimension (= 1 - TV(p, q))."""
    return torch.minimum(p, q).sum(-1)


def total_variation(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """TV(p, q) = 1/2 sum_x |p(x) - q(x)| over the last dimension."""
    return 0.5 * (p - q).abs().sum(-1)


def expected_tokens_by_length(betas: Sequence[float]) -> list[float]:
    """E(n) for n = 0..len(betas): expected tokens committed by a step that verifies the first n draft positions,
    bonus/correction token included: 1 + beta_1 + beta_1 beta_2 + ... (betas conditional on reaching the position).
    The one home of this sum: the controller's choices and the analysis both read it."""
    out, run = [1.0], 1.0
    for b in betas:
        _check_probability(b)
        run *= b
        out.append(out[-1] + run)
    return out


def expected_tokens(betas: Sequence[float]) -> float:
    """Expected tokens committed per verify step, bonus/correction token included: 1 + expected_accepted."""
    return expected_tokens_by_length(betas)[-1]


def expected_accepted(betas: Sequence[float]) -> float:
    """Expected accepted draft tokens per step: beta_1 + beta_1 beta_2 + ... (bonus excluded)."""
    return expected_tokens(betas) - 1.0


def expected_tokens_geometric(alpha: float, k: int) -> float:
    """Expected tokens per step with a constant acceptance probability alpha: (1 - a^(k+1)) / (1 - a)."""
    _check_probability(alpha)
    if alpha == 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def extend_betas(betas: Sequence[float], k: int) -> list[float]:
    """betas for positions 1..k, repeating the last known one beyond what was measured."""
    if not betas:
        raise ValueError("need at least one per-position acceptance probability")
    return [betas[min(i, len(betas) - 1)] for i in range(k)]


def speedup(betas: Sequence[float], k: int, c: float, relative_verify_cost: Callable[[int], float]) -> float:
    """Predicted speedup over plain decoding: E(k) / (k c + r(k)) with r(j) = verify_cost(j)/verify_cost(0)."""
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    return expected_tokens(extend_betas(betas, k) if k else []) / (k * c + relative_verify_cost(k))


def optimal_k(betas: Sequence[float], c: float, relative_verify_cost: Callable[[int], float],
              ks: Sequence[int] = range(1, 17)) -> tuple[int, float]:
    """(k, predicted speedup) maximising ``speedup`` over ``ks``."""
    scored = [(speedup(betas, k, c, relative_verify_cost), k) for k in ks]
    best, k = max(scored, key=lambda s: (s[0], -s[1]))
    return k, best


def step_speedup(steps: Sequence[tuple[int, int]], k: int, c: float,
                 relative_verify_cost: Callable[[int], float]) -> tuple[float, float]:
    """Prediction from recorded steps of a run at a larger k, for drafters whose draft length varies
    (an n-gram drafter proposes nothing when it has no match).

    Each step is (drafted d, accepted a). Capped at k, that step would have drafted min(d, k) tokens,
    committed min(a, k) + 1 and cost c min(d, k) + r(min(d, k)). Returns (tokens per step, speedup) as
    ratios of sums. When every step drafts k tokens this equals (E(k), speedup(k)) above."""
    if not steps:
        raise ValueError("no recorded steps")
    tokens = cost = 0.0
    for d, a in steps:
        dk = min(d, k)
        tokens += min(a, k) + 1
        cost += dk * c + relative_verify_cost(dk)
    return tokens / len(steps), tokens / cost


def replay_speedup(steps: Sequence[tuple[int, int]], k: int, c: float,
                   relative_verify_cost: Callable[[int], float]) -> tuple[float, float]:
    """Prediction that replays the accepted runs of a larger-k run at draft length k.

    Acceptance is bursty (an n-gram drafter copies whole passages, then misses), so capping each step at
    k (``step_speedup``) undercounts small k: a run of a accepted tokens at k_max is covered at draft
    length k by ceil((a+1)/(k+1)) steps of up to k+1 committed tokens each, every one drafting
    min(k, remaining draft) tokens (at least one: the drafter would propose again, and that extra draft
    is assumed rejected). Steps without a draft stay one-token steps. Returns (tokens per step, speedup)."""
    if not steps:
        raise ValueError("no recorded steps")
    tokens = cost = count = 0.0
    for d, a in steps:
        if d == 0:
            tokens, cost, count = tokens + 1, cost + relative_verify_cost(0), count + 1
            continue
        left, draft_left = a + 1, d
        while left > 0:
            dk = min(k, max(draft_left, 1))
            commit = min(left, k + 1)
            tokens += commit
            cost += dk * c + relative_verify_cost(dk)
            count += 1
            left -= commit
            draft_left -= commit
    return tokens / count, tokens / cost


def position_betas(steps: Sequence[tuple[int, int]], k: int) -> list[float]:
    """beta_i = P(position i accepted | positions < i accepted), from recorded (drafted, accepted) steps;
    a position that was not drafted counts as rejected (the step commits no token from it)."""
    out = []
    for i in range(1, k + 1):
        reached = sum(1 for _, a in steps if a >= i - 1)
        out.append(sum(1 for _, a in steps if a >= i) / reached if reached else 0.0)
    return out


def interpolate(points: dict[int, float]) -> Callable[[int], float]:
    """Piecewise-linear function through measured (x, y) points, flat beyond the ends."""
    xs = sorted(points)
    if not xs:
        raise ValueError("no points to interpolate")

    def f(x: float) -> float:
        if x <= xs[0]:
            return points[xs[0]]
        if x >= xs[-1]:
            return points[xs[-1]]
        hi = next(i for i, v in enumerate(xs) if v >= x)
        x0, x1 = xs[hi - 1], xs[hi]
        w = (x - x0) / (x1 - x0)
        return points[x0] * (1 - w) + points[x1] * w

    return f


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between closest ranks; None when there are no values."""
    return float(np.percentile(values, q)) if len(values) else None


def _check_probability(b: float) -> None:
    if not 0.0 <= b <= 1.0:
        raise ValueError(f"an acceptance probability must be in [0, 1], got {b}")
