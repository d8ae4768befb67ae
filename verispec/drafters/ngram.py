"""Prompt lookup: propose what followed the most recent earlier occurrence of the context's suffix.

No model is involved; drafts are deterministic, so the acceptance rule treats q as one-hot.

A draft costs a wider verify pass. On a GPU that is nearly free, but on a CPU verifying k+1 tokens can
cost ~1.8x a one-token step, so a draft that is rejected makes decoding *slower*. The drafter therefore
keeps, per match length n, a running mean of how many tokens its proposals got accepted, and stays
silent for match lengths whose proposals do not pay for themselves (``min_accept``); it re-probes a
silenced length every ``probe_every`` opportunities so that it notices when the text turns repetitive.
Set ``min_accept=0`` to always propose (transformers' prompt lookup behaviour).
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..errors import InvalidRequest
from ..sampling import SamplingParams
from .base import EMPTY_DRAFT, Draft


class NgramDrafter:
    name = "ngram"

    def __init__(
        self,
        min_n: int = 2,
        max_n: int = 4,
        min_accept: float = 1.0,
        probe_every: int = 8,
        smoothing: float = 0.3,
    ) -> None:
        if min_n < 1 or max_n < min_n:
            raise InvalidRequest(f"n-gram sizes need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        if min_accept < 0:
            raise InvalidRequest(f"min_accept must be >= 0, got {min_accept}")
        if probe_every < 1:
            raise InvalidRequest(f"probe_every must be >= 1, got {probe_every}")
        self.min_n, self.max_n = min_n, max_n
        self.min_accept = min_accept
        self.probe_every = probe_every
        self.smoothing = smoothing
        self.reset()

    def reset(self, sampling: SamplingParams | None = None, generator: torch.Generator | None = None) -> None:
        self._clear_index()
        sizes = range(self.min_n, self.max_n + 1)
        # optimistic start: every match length gets tried
        self._mean_accepted = {n: 3.0 for n in sizes}
        self._skipped = {n: 0 for n in sizes}
        self._last_n: int | None = None

    def _clear_index(self) -> None:
        self._tokens: list[int] = []
        self._indexed = 0  # n-grams ending at positions < _indexed are in the index
        # n -> {n-gram: position right after its most recent occurrence}
        self._index: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(self.min_n, self.max_n + 1)}

    def _sync(self, context: Sequence[int]) -> None:
        known = len(self._tokens)
        if len(context) < known or (known and context[known - 1] != self._tokens[-1]):
            self._clear_index()  # not an extension of what we indexed: start over
            known = 0
        self._tokens.extend(context[known:])
        tokens = self._tokens
        # index every n-gram that ends before the last position (the last one is the query itself)
        for end in range(self._indexed, len(tokens) - 1):
            for n, table in self._index.items():
                if end + 1 >= n:
                    table[tuple(tokens[end + 1 - n : end + 1])] = end + 1
        self._indexed = max(self._indexed, len(tokens) - 1)

    def match(self, context: Sequence[int], k: int) -> tuple[int, list[int]]:
        """(n, continuation): the longest suffix n-gram with an earlier occurrence and up to k tokens
        that followed its most recent occurrence; (0, []) when nothing matches."""
        self._sync(context)
        tokens = self._tokens
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            start = self._index[n].get(tuple(tokens[len(tokens) - n :]))
            if start is not None:
                return n, tokens[start : start + k]
        return 0, []

    def propose(self, context: Sequence[int], k: int) -> Draft:
        n, continuation = self.match(context, k)
        self._last_n = None
        if not continuation:
            return EMPTY_DRAFT
        if self._mean_accepted[n] < self.min_accept:
            self._skipped[n] += 1
            if self._skipped[n] % self.probe_every:
                return EMPTY_DRAFT
        self._last_n = n
        return Draft(continuation)

    def observe(self, num_accepted: int) -> None:
        n = self._last_n
        if n is None:
            return
        self._mean_accepted[n] += self.smoothing * (num_accepted - self._mean_accepted[n])
        if self._mean_accepted[n] >= self.min_accept:
            self._skipped[n] = 0
