"""Token trees: the tree attention mask, greedy tree verification, and the engine verifying trees in one pass."""

import random

import pytest
import torch
from transformers import DynamicCache

from verispec import SpeculativeDecoder
from verispec.drafters.base import Draft, DrafterBase
from verispec.tree import depths, tree_inputs
from verispec.verify import verify_tree_greedy

#        pending
#       /   |    \
#     n0(7) n1(8) n2(9)
#     /  \     \
#  n3(4) n4(5)  n5(4)
#   |
#  n6(6)
TOKENS = [7, 8, 9, 4, 5, 4, 6]
PARENTS = [-1, -1, -1, 0, 0, 1, 3]


def test_depths():
    assert depths(PARENTS) == [1, 1, 1, 2, 2, 2, 3]


def test_verify_tree_greedy_walks_the_targets_path():
    # after pending the target wants 7 (n0), after n0 -> 4 (n3), after n3 -> 6 (n6), after n6 -> 11 (no child)
    targets = {-1: 7, 0: 4, 3: 6, 6: 11}
    row = [targets.get(i, 0) for i in range(-1, len(TOKENS))]
    assert verify_tree_greedy(TOKENS, PARENTS, row) == ([0, 3, 6], 11)
    row[0] = 8  # the middle branch
    row[2] = 4  # after n1 -> 4 (n5), after n5 -> 0
    assert verify_tree_greedy(TOKENS, PARENTS, row) == ([1, 5], 0)
    row[0] = 3  # nothing matches at depth 1: the target's own token is committed
    assert verify_tree_greedy(TOKENS, PARENTS, row) == ([], 3)
    with pytest.raises(ValueError):
        verify_tree_greedy([1, 2], [1, -1], [0, 0, 0])


def test_tree_forward_equals_a_plain_forward_of_each_branch(tiny_target):
    """With the tree mask and positions, each node's logits equal those of running its own branch alone."""
    model = tiny_target.model
    context = [5, 9, 3, 5, 9, 4]
    past = context[:-2]
    with torch.no_grad():
        cache = DynamicCache()
        model(input_ids=torch.tensor([past]), cache=cache, use_cache=True)
        positions, mask = tree_inputs(len(past), 2, PARENTS, torch.float32)
        logits = model(input_ids=torch.tensor([context[-2:] + TOKENS]), cache=cache, use_cache=True,
                       position_ids=positions, attention_mask=mask).logits[0]
        for i in range(len(TOKENS)):
            branch, node = [], i
            while node >= 0:
                branch.insert(0, TOKENS[node])
                node = PARENTS[node]
            alone = model(input_ids=torch.tensor([context + branch])).logits[0, -1]
            assert torch.allclose(logits[2 + i], alone, atol=1e-5), i
        assert torch.allclose(logits[1], model(input_ids=torch.tensor([context])).logits[0, -1], atol=1e-5)


class OracleTreeDrafter(DrafterBase):
    """Proposes a tree whose branches are the true greedy continuation (from ``truth``, when known) mixed with
    random siblings and random subtrees, so every shape of acceptance happens."""

    name = "oracle-tree"

    def __init__(self, truth: list[int], vocab: int, seed: int = 0):
        self.truth, self.vocab, self.rng = truth, vocab, random.Random(seed)

    def propose(self, context, k):
        tokens, parents = [], []
        done = len(context)
        right = self.truth[done : done + k] if self.truth[:done] == list(context) else []
        parent = -1
        for depth, token in enumerate(right):
            if len(tokens) >= k:
                break
            if self.rng.random() < 0.3 and len(tokens) < k:  # a wrong sibling first
                tokens.append((token + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab)
                parents.append(parent)
            if len(tokens) >= k:
                break
            if self.rng.random() < 0.15:  # sometimes the right token is missing: a rejection here
                break
            tokens.append(token)
            parents.append(parent)
            parent = len(tokens) - 1
        while len(tokens) < k:  # junk subtree
            tokens.append(self.rng.randrange(self.vocab))
            parents.append(self.rng.randrange(-1, len(tokens) - 1))
        return Draft(tokens, None, parents)


@pytest.mark.parametrize("k", [1, 3, 8, 16])
def test_engine_tree_greedy_equals_plain_greedy(tiny_target, k):
    for prompt in ([5, 9, 3, 5, 9, 4, 7], [12, 30, 7]):
        plain = SpeculativeDecoder(tiny_target).generate(prompt, max_new_tokens=40)
        truth = prompt + plain.token_ids
        for seed in range(3):
            drafter = OracleTreeDrafter(truth, tiny_target.vocab_size, seed)
            got = SpeculativeDecoder(tiny_target, drafter, k=k, k_policy="fixed").generate(prompt, max_new_tokens=40)
            assert got.token_ids == plain.token_ids, (k, seed)
            if k >= 3:
                assert got.stats.accepted > 0 and got.stats.verify_steps < 40


def test_a_tree_steps_accepted_path_stays_cached_and_is_not_fed_again(tiny_target, monkeypatch):
    prompt = [5, 9, 3, 5, 9, 4, 7]
    plain = SpeculativeDecoder(tiny_target).generate(prompt, max_new_tokens=30)
    fed = []
    forward = tiny_target.forward

    def recording(kv, tokens, parents=None, **kw):
        if parents is not None:
            fed.append(len(tokens) - len(parents))
        return forward(kv, tokens, parents=parents, **kw)

    monkeypatch.setattr(tiny_target, "forward", recording)
    decoder = SpeculativeDecoder(tiny_target, OracleTreeDrafter(prompt + plain.token_ids, tiny_target.vocab_size),
                                 k=6, k_policy="fixed")
    out = decoder.generate(prompt, max_new_tokens=30)
    assert out.token_ids == plain.token_ids and out.stats.accepted > 0
    assert set(fed) == {1}  # only the pending token, whatever the last tree accepted


def test_sampled_trees_follow_the_target_distribution(tiny_target):
    """Trees are verified at any temperature: the oracle's random trees (the plain greedy path plus random
    siblings) at temperature 1 against the exact joint distribution of the first three tokens."""
    from statistical_helpers import ALPHA, joint_p_value
    from verispec import SamplingParams

    decoder = SpeculativeDecoder(tiny_target, OracleTreeDrafter([], tiny_target.vocab_size), k=4, k_policy="fixed")
    assert joint_p_value(decoder, SamplingParams(temperature=1.0)) > ALPHA
    out = decoder.generate([5, 9, 3], max_new_tokens=12, temperature=1.0, seed=0)
    assert out.stats.drafted > 0


def test_tree_steps_leave_the_cache_equal_to_a_fresh_prefill(tiny_target):
    prompt = [3, 4, 5, 6, 7, 8]
    plain = SpeculativeDecoder(tiny_target).generate(prompt, max_new_tokens=30)
    decoder = SpeculativeDecoder(tiny_target, OracleTreeDrafter(prompt + plain.token_ids, 32), k=6, k_policy="fixed", reuse_prefix=True)
    out = decoder.generate(prompt, max_new_tokens=30)
    cached = decoder._cached_tokens
    assert cached == (prompt + out.token_ids)[: len(cached)] and len(cached) >= len(prompt)
    fresh = DynamicCache()
    with torch.no_grad():
        tiny_target.model(input_ids=torch.tensor([cached]), cache=fresh, use_cache=True)
    for a, b in zip(decoder._cache.cache.layers, fresh.layers):
        assert torch.allclose(a.keys, b.keys, atol=1e-5) and torch.allclose(a.values, b.values, atol=1e-5)
    # and the next request reuses it
    again = decoder.generate(prompt + out.token_ids[:10], max_new_tokens=10)
    assert again.stats.reused_prompt_tokens > len(prompt)


def test_ngram_trees_are_lossless_greedy_and_sampled(tiny_target):
    from statistical_helpers import ALPHA, joint_p_value
    from verispec import NgramDrafter, SamplingParams

    prompt = [5, 9, 3, 5, 9, 4, 5, 9, 7, 5, 9]
    plain = SpeculativeDecoder(tiny_target).generate(prompt, max_new_tokens=30)
    tree = SpeculativeDecoder(tiny_target, NgramDrafter(min_n=1, max_n=2, branches=3), k=6, k_policy="fixed")
    out = tree.generate(prompt, max_new_tokens=30)
    assert out.token_ids == plain.token_ids and out.stats.drafted > 0
    assert joint_p_value(tree, SamplingParams(temperature=1.0)) > ALPHA
