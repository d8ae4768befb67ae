"""Prompt lookup: propose what followed the most recent earlier occurrence of the context's suffix.

No model is involved; drafts are deterministic, so the acceptance rule treats q as one-hot. Drafting costs
microseconds, so the drafter always proposes when it finds a match and reports how long the match was as its
confidence; whether a proposal is worth a wider verify pass on this machine is the engine's controller's call
(``verispec.controller``), which calibrates that confidence against what the target accepts.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..errors import InvalidRequest, check_whole
from ..sampling import SamplingParams
from .base import EMPTY_DRAFT, Draft, DrafterBase
from .registry import DrafterSpec, Option, register


class NgramDrafter(DrafterBase):
    name = "ngram"
    flat_cost = True  # a lookup: a longer draft costs no more

    def __init__(self, min_n: int = 2, max_n: int = 4, branches: int = 1) -> None:
        check_whole("n-gram min_n", min_n)
        check_whole("n-gram max_n", max_n)
        if max_n < min_n:
            raise InvalidRequest(f"n-gram sizes need 1 <= min_n <= max_n, got min_n={min_n!r}, max_n={max_n!r}")
        check_whole("n-gram branches", branches, 1, 16)
        self.min_n, self.max_n, self.branches = min_n, max_n, branches
        # with several branches the drafter proposes a tree (any temperature: its candidates are deterministic)
        self.tree_depth = None if branches == 1 else 64
        self.reset()

    def reset(self, sampling: SamplingParams | None = None, generator: torch.Generator | None = None) -> None:
        self._tokens: list[int] = []
        self._indexed = 0  # n-grams ending at positions < _indexed are in the index
        # n -> {n-gram: positions right after its most recent occurrences, oldest first, at most `branches`}
        self._index: dict[int, dict[tuple[int, ...], list[int]]] = {n: {} for n in range(self.min_n, self.max_n + 1)}

    def _sync(self, context: Sequence[int]) -> None:
        known = len(self._tokens)
        if len(context) < known or (known and context[known - 1] != self._tokens[-1]):
            self.reset()  # not an extension of what we indexed: start over
            known = 0
        self._tokens.extend(context[known:])
        tokens = self._tokens
        # index every n-gram that ends before the last position (the last one is the query itself)
        for end in range(self._indexed, len(tokens) - 1):
            for n, table in self._index.items():
                if end + 1 >= n:
                    seen = table.setdefault(tuple(tokens[end + 1 - n : end + 1]), [])
                    seen.append(end + 1)
                    if len(seen) > self.branches:
                        del seen[0]
        self._indexed = max(self._indexed, len(tokens) - 1)

    def match(self, context: Sequence[int], k: int) -> tuple[int, list[int]]:
        """(n, continuation): the longest suffix n-gram with an earlier occurrence and up to k tokens
        that followed its most recent occurrence; (0, []) when nothing matches."""
        self._sync(context)
        tokens = self._tokens
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            starts = self._index[n].get(tuple(tokens[len(tokens) - n :]))
            if starts:
                return n, tokens[starts[-1] : starts[-1] + k]
        return 0, []

    def follow(self, context: Sequence[int], tail: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that followed the most recent earlier occurrence in ``context`` (indexed, as ``match``
        does) of the longest suffix n-gram of ``context + tail``; [] for none. ``tail`` (tokens past the context,
        e.g. a draft) is matched but not indexed, so the index stays the context's as it grows."""
        self._sync(context)
        tokens = self._tokens
        probe = [*tokens[max(0, len(tokens) - self.max_n):], *tail]
        for n in range(min(self.max_n, len(probe)), self.min_n - 1, -1):
            starts = self._index[n].get(tuple(probe[len(probe) - n :]))
            if starts:
                return tokens[starts[-1] : starts[-1] + k]
        return []

    def continuations(self, context: Sequence[int], k: int) -> list[list[int]]:
        """Up to ``branches`` distinct continuations: what followed the most recent occurrences of the longest
        matching suffix n-gram first, then of shorter ones."""
        self._sync(context)
        tokens, found = self._tokens, []
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            for start in reversed(self._index[n].get(tuple(tokens[len(tokens) - n :]), [])):
                branch = tokens[start : start + k]
                if branch and branch not in found:
                    found.append(branch)
                if len(found) == self.branches:
                    return found
        return found

    def propose(self, context: Sequence[int], k: int) -> Draft:
        if self.branches > 1:
            return self._tree(context, k)
        n, continuation = self.match(context, k)
        if not continuation:
            return EMPTY_DRAFT
        # a longer match is likelier to continue the same way; the controller learns what each length is worth
        return Draft(continuation, confidence=[n / (n + 1)] * len(continuation))

    def _tree(self, context: Sequence[int], k: int) -> Draft:
        """The continuations merged into one tree of at most k nodes (shared prefixes share nodes)."""
        tokens: list[int] = []
        parents: list[int] = []
        children: dict[tuple[int, int], int] = {}
        for branch in self.continuations(context, k):
            node = -1
            for token in branch:
                child = children.get((node, token))
                if child is None:
                    if len(tokens) == k:
                        break
                    tokens.append(token)
                    parents.append(node)
                    child = children[(node, token)] = len(tokens) - 1
                node = child
        return Draft(tokens, None, parents) if tokens else EMPTY_DRAFT


register(DrafterSpec(
    "ngram", "prompt lookup: what followed the latest earlier occurrence of the context's last n tokens",
    lambda target, draft_model, **options: NgramDrafter(**options),
    options=(Option("min_n", int, 2, "shortest suffix n-gram the ngram drafter matches (default: 2)", "ngram-min"),
             Option("max_n", int, 4, "longest suffix n-gram the ngram drafter matches (default: 4)", "ngram-max"),
             Option("branches", int, 1, "with more than 1, the ngram drafter proposes a tree of what followed that "
                    "many earlier matches (default: 1, a chain)", "ngram-branches")),
    trees=lambda options: options.get("branches", 1) > 1, tree_option="branches",
))
