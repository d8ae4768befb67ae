"""Several samples of one prompt (OpenAI's ``n``): rows of one batch, the prompt prefilled once, seeds seed + i,
each drafting from its siblings' text; and the exact test that they stay lossless jointly.

Why the joint law is the product: sample j's next tokens are decided by the strict rule with sample j's own
generator against the target's p given sample j's own prefix. The draft (whatever a sibling wrote) is a function of
what was written before, and for any fixed draft the rule yields tokens distributed exactly as p; so conditioned on
everything the siblings wrote, sample j's tokens follow the target, and the samples are independent draws. The test
checks it on an enumerable vocabulary, and fails for two plausible wrong rules.
"""

import pytest
import torch

import verispec.batching as batching
from tiny import loaded, make_model
from verispec import NgramDrafter, SamplingParams, SpeculativeDecoder
from verispec.audit import chi_square
from verispec.batching import generate_samples, sample_seeds
from verispec.drafters.suffix import SuffixDrafter
from verispec.errors import InvalidRequest
from verispec.sampling import probabilities

ALPHA = 1e-3
PROMPT = [3, 1, 2, 3, 1]  # within a 5-token vocabulary; (3, 1) recurs, so the first sample drafts from the prompt
SAMPLES = 3000


def test_siblings_draft_from_each_others_text_and_others_do_not():
    prompt, written = [3, 4, 5, 6], [9, 8, 7]
    for scope in ("request", "process"):
        group: dict = {}
        a, b = SuffixDrafter(scope=scope), SuffixDrafter(scope=scope)
        a.isolate(), b.isolate()  # no other test's text
        a.join_siblings(group), b.join_siblings(group)
        a.reset(), b.reset()
        a.propose(prompt + written, 3)
        assert b.propose(prompt, 3).tokens == written  # b continues the prompt as a did
        c = SuffixDrafter(scope="request")  # a request of its own sees neither
        c.reset()
        assert c.propose(prompt, 3).tokens == []
        a.join_siblings(None)
        a.reset()  # out of the group (scope request: a store of its own again)
        if scope == "request":
            assert a.propose(prompt, 3).tokens == []


def test_samples_prefill_the_prompt_once_and_take_seeds_seed_plus_i(tiny_target):
    prompt = [5, 9, 3, 5, 9, 3, 5]
    decoders = [SpeculativeDecoder(tiny_target, SuffixDrafter(scope="request"), k=3) for _ in range(3)]
    greedy = generate_samples(decoders, prompt, max_new_tokens=12, temperature=0.0, seed=41)
    plain = SpeculativeDecoder(tiny_target).generate(prompt, max_new_tokens=12).token_ids
    assert [g.token_ids for g in greedy] == [plain] * 3
    assert [g.seed for g in greedy] == [41, 42, 43]
    # the first sample prefills; the others copy its keys and values (all but the pending last token)
    assert [g.stats.reused_prompt_tokens for g in greedy] == [0, len(prompt) - 1, len(prompt) - 1]
    sampled = generate_samples(decoders, prompt, max_new_tokens=12, temperature=1.0)
    assert len({g.seed for g in sampled}) == 3  # no seed given: each draws its own
    assert sample_seeds(2**63 - 1, 2) == [2**63 - 1, 0]


def test_bad_sample_calls_name_the_fix(tiny_target):
    decoder = SpeculativeDecoder(tiny_target, NgramDrafter())
    with pytest.raises(InvalidRequest, match="its own decoder"):
        generate_samples([decoder, decoder], [5, 9])
    with pytest.raises(InvalidRequest, match="one decoder per sample"):
        generate_samples([], [5, 9])


@pytest.fixture(scope="module")
def small_vocab():
    return loaded(make_model(seed=0, vocab=5))


def exact_pair(target, sampling):
    """P(first two tokens of sample A, first two of sample B) if the samples are independent draws: [V**4]."""
    vocab = target.vocab_size
    with torch.no_grad():
        prefix = torch.tensor([PROMPT])
        p1 = probabilities(target.model(prefix).logits[:, -1], sampling).double()[0]
        second = torch.cat([prefix.repeat(vocab, 1), torch.arange(vocab)[:, None]], 1)
        p2 = probabilities(target.model(second).logits[:, -1], sampling).double()
    one = (p1[:, None] * p2).reshape(-1)
    return (one[:, None] * one[None, :]).reshape(-1)


def pair_p_value(target, decoder_class=SpeculativeDecoder, samples: int = SAMPLES) -> float:
    sampling = SamplingParams(temperature=1.0)
    vocab = target.vocab_size
    decoders = [decoder_class(target, SuffixDrafter(scope="request"), k=3, k_policy="fixed") for _ in range(2)]
    counts = torch.zeros(vocab**4, dtype=torch.float64)
    sibling_drafts = 0
    for i in range(samples):
        a, b = generate_samples(decoders, PROMPT, seed=1000 + 7 * i, max_new_tokens=6, temperature=1.0)
        x, y = a.token_ids[:2], b.token_ids[:2]
        counts[((x[0] * vocab + x[1]) * vocab + y[0]) * vocab + y[1]] += 1
        sibling_drafts += b.stats.step_drafted[0] > 0  # the second sample's first step: its drafts are the first's
    assert sibling_drafts > samples // 2  # the siblings' text is really drafted from
    _, _, p_value, cells = chi_square(counts, exact_pair(target, sampling) * samples)
    assert cells > 40 * samples // SAMPLES
    return p_value


def test_two_samples_drafting_from_each_other_are_independent_draws_of_the_target(small_vocab):
    assert pair_p_value(small_vocab) > ALPHA


def test_the_joint_test_fails_when_the_samples_share_a_seed(small_vocab, monkeypatch):
    monkeypatch.setattr(batching, "sample_seeds", lambda seed, n: [seed] * n)
    assert pair_p_value(small_vocab, samples=SAMPLES // 4) < 1e-6  # a gross failure: a quarter of the samples


class TrustingDecoder(SpeculativeDecoder):
    """A wrong rule: accept every drafted token untested (as one might for tokens a sibling already sampled from
    the target), then sample the next token from p."""

    def _verify_chain(self, state, draft, p):
        n = len(draft.tokens)
        return n, int(torch.multinomial(p[n], 1, generator=state.generator))


def test_the_joint_test_fails_when_sibling_drafts_are_trusted(small_vocab):
    assert pair_p_value(small_vocab, TrustingDecoder, samples=SAMPLES // 4) < 1e-6
