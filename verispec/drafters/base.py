"""The drafter protocol: every drafter plugs into the same engine loop through these three methods."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

import torch

from ..sampling import SamplingParams


@dataclass
class Draft:
    """Proposed continuation. ``probs`` is q, the drafter's distribution for each token ([k, vocab]),
    or None when the drafter is deterministic (then q is one-hot on each proposed token)."""

    tokens: list[int]
    probs: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.tokens)


EMPTY_DRAFT = Draft([])


@runtime_checkable
class Drafter(Protocol):
    name: str

    def reset(self, sampling: SamplingParams, generator: torch.Generator | None) -> None:
        """Start a new sequence; drafters that sample use these parameters and this generator."""

    def propose(self, context: Sequence[int], k: int) -> Draft:
        """Up to ``k`` tokens that may follow ``context`` (all committed tokens, prompt included)."""

    def observe(self, num_accepted: int) -> None:
        """How many tokens of the last proposal the target accepted."""
