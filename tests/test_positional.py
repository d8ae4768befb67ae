"""Position-keyed sampling: with one-hot drafts (n-gram, suffix, trees of candidates) the token at each position is
drawn with the uniform of (seed, position), so seeded output is the same with or without drafting, whatever the
draft length, the controller or the batch. The distribution tests (tests/test_statistical.py, test_tree_sampling.py)
check that it is still the target's."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verispec import NgramDrafter, SpeculativeDecoder
from verispec.audit import chi_square
from verispec.batching import generate_batch
from verispec.drafters.suffix import SuffixDrafter, SuffixStore
from verispec.sampling import position_uniform, sample_at
from verispec.verify import verify_positional, verify_tree_positional

PROMPT = [5, 9, 3, 5, 9, 3, 5, 9]


def test_position_uniforms_are_uniform_and_keyed():
    u = torch.tensor([position_uniform(7, i) for i in range(20000)], dtype=torch.float64)
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    counts = torch.histc(u, bins=50, min=0.0, max=1.0)
    _, _, p_value, _ = chi_square(counts, torch.full((50,), 400.0))
    assert p_value > 1e-3
    assert position_uniform(7, 3) == position_uniform(7, 3) != position_uniform(8, 3) != position_uniform(7, 4)
    across = torch.tensor([position_uniform(s, 0) for s in range(20000)], dtype=torch.float64)  # seeds 0, 1, 2, ...
    _, _, p_value, _ = chi_square(torch.histc(across, bins=50, min=0.0, max=1.0), torch.full((50,), 400.0))
    assert p_value > 1e-3


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**63 - 1), st.integers(0, 500), st.lists(st.integers(0, 5), max_size=6), st.integers(0, 99))
def test_the_committed_tokens_are_the_plain_draws_whatever_the_draft(seed, position, draft, salt):
    gen = torch.Generator().manual_seed(salt)
    p = torch.softmax(3 * torch.randn(len(draft) + 1, 6, generator=gen), -1)
    plain = [sample_at(p[i], position_uniform(seed, position + i)) for i in range(len(draft) + 1)]
    verdict = verify_positional(draft, p, seed, position)
    assert draft[:verdict.num_accepted] == plain[:verdict.num_accepted]
    assert verdict.next_token == plain[verdict.num_accepted]
    assert verify_positional(plain[:-1], p, seed, position).num_accepted == len(draft)  # the draws are accepted


def test_tree_walk_follows_the_plain_draws():
    p = torch.softmax(torch.randn(5, 6, generator=torch.Generator().manual_seed(0)), -1)
    tokens, parents = [0, 1, 2, 3], [-1, -1, 0, 0]  # root children 0 and 1; node 0's children 2 and 3
    for seed in range(200):
        path, nxt = verify_tree_positional(tokens, parents, p, seed, 40)
        first = sample_at(p[0], position_uniform(seed, 40))
        if first not in (0, 1):
            assert (path, nxt) == ([], first)
        elif first == 1:  # node 1 has no children: the next draw comes from its row
            assert path == [1] and nxt == sample_at(p[2], position_uniform(seed, 41))
        else:
            second = sample_at(p[1], position_uniform(seed, 41))
            assert path[0] == 0 and (path[1:] == [2 if second == 2 else 3] if second in (2, 3) else path == [0])


DRAFTERS = {
    "ngram": lambda: NgramDrafter(),
    "ngram-tree": lambda: NgramDrafter(branches=3),
    "suffix": lambda: SuffixDrafter(store=SuffixStore()),
    "suffix-tree": lambda: SuffixDrafter(tree=True, store=SuffixStore()),
}


@pytest.mark.parametrize("name", DRAFTERS)
@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.8, top_p=0.9, top_k=12)])
def test_seeded_sampling_gives_plain_decodings_tokens(tiny_target, name, sampling):
    plain = SpeculativeDecoder(tiny_target)
    for k, policy in ((3, "fixed"), (6, "fixed"), (8, "cost")):
        spec = SpeculativeDecoder(tiny_target, DRAFTERS[name](), k=k, k_policy=policy)
        for seed in range(4):
            want = plain.generate(PROMPT, max_new_tokens=20, seed=seed, **sampling).token_ids
            got = spec.generate(PROMPT, max_new_tokens=20, seed=seed, **sampling)
            assert got.token_ids == want, (name, k, seed)
    assert got.stats.drafted > 0 or policy == "cost"


def test_seeded_sampling_is_the_same_inside_a_batch(tiny_target):
    prompts = [PROMPT, [7, 8, 9, 7, 8], PROMPT[:5], [4, 4, 4]]
    decoders = [SpeculativeDecoder(tiny_target, NgramDrafter(), k=4, k_policy="fixed") for _ in prompts]
    batched = generate_batch(decoders, prompts, max_new_tokens=16, temperature=1.0, seed=11)
    plain = SpeculativeDecoder(tiny_target)
    assert [g.token_ids for g in batched] == [plain.generate(p, max_new_tokens=16, temperature=1.0, seed=11).token_ids
                                              for p in prompts]
