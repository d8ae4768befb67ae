"""The tree acceptance rule when sampling, checked exactly: every path of the rule's randomness (and of the
drafter's, for sampled children) is enumerated with its probability on a 4-token vocabulary, and the distribution
of the committed tokens is compared with the target's own to floating-point tolerance."""

import itertools
from collections import defaultdict

import pytest
import torch
from hypothesis import given, settings, strategies as st

from verispec.verify import TorchCoins, verify_tree, verify_tree_greedy

V = 4
HORIZON = 3


def target(context: tuple[int, ...]) -> torch.Tensor:
    """A fixed distribution per context; some contexts give a token probability 0."""
    gen = torch.Generator().manual_seed(hash(context) % (2**31))
    probs = torch.rand(V, generator=gen, dtype=torch.float64) ** 2
    if len(context) % 2:
        probs[len(context) % V] = 0.0
    return probs / probs.sum()


def target_sequence(context, tokens) -> float:
    prob = 1.0
    for t, token in enumerate(tokens):
        prob *= float(target(context + tuple(tokens[:t]))[token])
    return prob


class Enumerate:
    """A stand-in for ``TorchCoins`` that follows a script of choices and takes the first option beyond it,
    recording how many options each decision had and the probability of the path."""

    def __init__(self, script):
        self.script, self.taken, self.sizes, self.prob = script, [], [], 1.0

    def _choose(self, options, weights):
        i = len(self.taken)
        c = self.script[i] if i < len(self.script) else 0
        self.taken.append(c)
        self.sizes.append(len(options))
        self.prob *= weights[c]
        return options[c]

    def bernoulli(self, probability):
        if probability >= 1.0:
            return True
        if probability <= 0.0:
            return False
        return self._choose([True, False], [probability, 1.0 - probability])

    def categorical(self, probs):
        options = [i for i in range(len(probs)) if float(probs[i]) > 0]
        total = sum(float(probs[i]) for i in options)
        return self._choose(options, [float(probs[i]) / total for i in options])


def enumerate_outcomes(run) -> dict[tuple, float]:
    """Exact distribution of run(coins) over every sequence of random choices."""
    out: dict[tuple, float] = defaultdict(float)
    stack = [[]]
    while stack:
        script = stack.pop()
        coins = Enumerate(script)
        result = run(coins)
        for depth in range(len(script), len(coins.sizes)):
            stack.extend(coins.taken[:depth] + [alt] for alt in range(1, coins.sizes[depth]))
        out[result] += coins.prob
    return out


def committed_distribution(context, outcomes) -> dict[tuple, float]:
    """Distribution of the first HORIZON committed tokens: a step that commits fewer is continued by the target
    itself (what the next steps do, exactly, as the chain rule is already proven)."""
    dist: dict[tuple, float] = defaultdict(float)
    for committed, prob in outcomes.items():
        head = committed[:HORIZON]
        for tail in itertools.product(range(V), repeat=HORIZON - len(head)):
            dist[head + tail] += prob * target_sequence(context + head, list(tail))
    return dist


def assert_matches_target(context, outcomes):
    assert sum(outcomes.values()) == pytest.approx(1.0, abs=1e-12)
    dist = committed_distribution(context, outcomes)
    for seq in itertools.product(range(V), repeat=HORIZON):
        assert dist.get(seq, 0.0) == pytest.approx(target_sequence(context, list(seq)), abs=1e-12), seq


def tree_rows(context, tokens, parents) -> torch.Tensor:
    rows, paths = [target(context)], []
    for token, parent in zip(tokens, parents):
        path = (paths[parent] if parent >= 0 else ()) + (token,)
        paths.append(path)
        rows.append(target(context + path))
    return torch.stack(rows)


def run_tree(context, tokens, parents, q=None):
    p = tree_rows(context, tokens, parents)

    def run(coins):
        path, nxt = verify_tree(tokens, parents, p, coins, q)
        return tuple(tokens[i] for i in path) + (nxt,)
    return run


TREES = {
    "one chain": ([2, 1, 0], [-1, 0, 1]),
    "siblings at the root": ([0, 1, 3], [-1, -1, -1]),
    "every token at the root": ([3, 2, 1, 0], [-1, -1, -1, -1]),
    "two levels, branching twice": ([1, 2, 0, 3, 1, 2], [-1, -1, 0, 0, 1, 1]),
    "a duplicate sibling": ([1, 1, 2], [-1, -1, 0]),
    "deep and wide": ([0, 1, 2, 3, 0, 1, 2], [-1, -1, 0, 0, 2, 2, 4]),
}


@pytest.mark.parametrize("name", TREES)
@pytest.mark.parametrize("context", [(1,), (2, 3)])
def test_deterministic_candidates_give_exactly_the_target_distribution(name, context):
    tokens, parents = TREES[name]
    assert_matches_target(context, enumerate_outcomes(run_tree(context, tokens, parents)))


@pytest.mark.parametrize("siblings", [1, 2, 3])
@pytest.mark.parametrize("context", [(0,), (3, 1)])
def test_children_sampled_from_q_with_replacement_give_exactly_the_target_distribution(siblings, context):
    """The drafter samples `siblings` children of the root i.i.d. from q, and one child under the first of them
    from q again; the enumeration covers the drafter's draws too."""
    q_root = torch.tensor([0.5, 0.1, 0.3, 0.1], dtype=torch.float64)
    q_deep = torch.tensor([0.05, 0.05, 0.1, 0.8], dtype=torch.float64)

    def run(coins):
        tokens = [coins.categorical(q_root) for _ in range(siblings)] + [coins.categorical(q_deep)]
        parents = [-1] * siblings + [0]
        p = tree_rows(context, tokens, parents)
        path, nxt = verify_tree(tokens, parents, p, coins, {-1: q_root, 0: q_deep})
        return tuple(tokens[i] for i in path) + (nxt,)

    assert_matches_target(context, enumerate_outcomes(run))


def test_the_test_has_power():
    """Accepting a candidate whenever the target gives it any probability (a plausible-looking mistake) is caught."""
    class Greedy(Enumerate):
        def bernoulli(self, probability):
            return probability > 0 or super().bernoulli(probability)

    tokens, parents = TREES["siblings at the root"]
    p = tree_rows((1,), tokens, parents)
    out: dict[tuple, float] = defaultdict(float)
    stack = [[]]
    while stack:
        script = stack.pop()
        coins = Greedy(script)
        path, nxt = verify_tree(tokens, parents, p, coins)
        for depth in range(len(script), len(coins.sizes)):
            stack.extend(coins.taken[:depth] + [alt] for alt in range(1, coins.sizes[depth]))
        out[tuple(tokens[i] for i in path) + (nxt,)] += coins.prob
    with pytest.raises(AssertionError):
        assert_matches_target((1,), out)


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_at_temperature_zero_the_rule_is_greedy_tree_verification(data):
    n = data.draw(st.integers(0, 8))
    parents = [data.draw(st.integers(-1, i - 1)) for i in range(n)]
    tokens = [data.draw(st.integers(0, V - 1)) for _ in range(n)]
    greedy = [data.draw(st.integers(0, V - 1)) for _ in range(n + 1)]
    p = torch.nn.functional.one_hot(torch.tensor(greedy), V).double()
    assert verify_tree(tokens, parents, p, TorchCoins(torch.Generator().manual_seed(0))) == \
        verify_tree_greedy(tokens, parents, greedy)
