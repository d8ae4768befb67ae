"""Exact-distribution helpers for the statistical tests (a tiny vocabulary is enumerated)."""

import torch

from verispec.audit import chi_square
from verispec.sampling import probabilities

PROMPT = [5, 9, 3, 5, 9]  # the suffix (5, 9) recurs, so the n-gram drafter proposes from the first step
SAMPLES = 2500
ALPHA = 1e-3


def exact_joint(target, prompt, sampling, positions=3):
    """P(x_1..x_positions | prompt) for every sequence, by enumeration ([V] * positions)."""
    vocab = target.vocab_size
    joint = torch.ones(1, dtype=torch.float64)
    prefixes = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(positions):
            logits = target.model(prefixes).logits[:, -1]  # [V^j, V]
            p = probabilities(logits, sampling).double()
            joint = (joint[:, None] * p).reshape(-1)
            prefixes = torch.cat(
                [prefixes.repeat_interleave(vocab, 0), torch.arange(vocab).repeat(prefixes.shape[0])[:, None]], 1)
    return joint


def sampled_joint(decoder, prompt, sampling, positions=3, samples=SAMPLES):
    vocab = decoder.target.vocab_size
    counts = torch.zeros(vocab**positions, dtype=torch.float64)
    for seed in range(samples):
        ids = decoder.generate(prompt, max_new_tokens=positions, temperature=sampling.temperature,
                               top_k=sampling.top_k, top_p=sampling.top_p, seed=seed).token_ids
        index = 0
        for t in ids:
            index = index * vocab + t
        counts[index] += 1
    return counts


def joint_p_value(decoder, sampling):
    exact = exact_joint(decoder.target, PROMPT, sampling)
    observed = sampled_joint(decoder, PROMPT, sampling)
    _, _, p_value, cells = chi_square(observed, exact * SAMPLES)
    assert cells > 20  # the test has many cells, not a degenerate one
    return p_value
