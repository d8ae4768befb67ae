"""Shared prefixes of token sequences: what a cache (or a drafter's state) built for one sequence can give another.

The lone decoder reuses its last request's cache for the next prompt, the batch engine copies a prefix from another
sequence's cache, and drafters realign their own caches with the committed context: all through these two helpers.
"""

from __future__ import annotations

from typing import Sequence


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def reusable_prefix(cached: Sequence[int], tokens: Sequence[int], with_features: int | None = None) -> int:
    """Leading tokens of ``tokens`` that a cache holding exactly ``cached`` can give it: the longest shared prefix,
    never the last (pending) token, which the first step feeds; and, when a drafter reads hidden states, no more
    than the ``with_features`` positions that have them."""
    n = min(common_prefix_length(cached, tokens), len(tokens) - 1)
    return n if with_features is None else min(n, with_features)
