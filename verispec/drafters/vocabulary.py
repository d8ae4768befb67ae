"""A head's draft vocabulary, grown per request by the tokens of its context.

Trained heads (EAGLE, Medusa) score a reduced vocabulary: ``d2t`` maps draft ids to target ids. Tokens a request
copies from its prompt are often rare ones that vocabulary lacks, so each request adds every context token outside
it, scored with the same frozen lm_head rows of the target (``extra``, appended after the base ids).
"""

from __future__ import annotations

from typing import Sequence

import torch


class ContextVocabulary:
    def __init__(self, d2t: torch.Tensor, lm_head: torch.Tensor, vocab_size: int, dtype: torch.dtype):
        self._d2t = d2t
        self._lm_head = lm_head  # [V, H], the target's full output embedding
        self._base = set(d2t.tolist())
        self.vocab_size = vocab_size
        self.dtype = dtype
        self.reset()

    def reset(self) -> None:
        self.ids: list[int] = self._d2t.tolist()  # draft id -> target id
        self.ids_tensor = self._d2t
        self.extra: torch.Tensor | None = None  # lm_head rows of the added tokens [E, H]
        self._seen: set[int] = set()
        self.scanned = 0  # context tokens looked at so far

    def grow(self, context: Sequence[int]) -> None:
        """Add the tokens of ``context`` not seen yet (a shorter context is a new sequence: start over)."""
        if self.scanned > len(context):
            self.reset()
        new = []
        for token in context[self.scanned :]:
            if token not in self._base and token not in self._seen and 0 <= token < self.vocab_size:
                self._seen.add(token)
                new.append(token)
        self.scanned = len(context)
        if new:
            rows = self._lm_head[torch.tensor(new, device=self._lm_head.device)].to(self.dtype)
            self.extra = rows if self.extra is None else torch.cat([self.extra, rows])
            self.ids = self.ids + new
            self.ids_tensor = torch.tensor(self.ids, device=self._d2t.device)

    def full(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [..., D] placed in the target's vocabulary [..., V] (-inf elsewhere)."""
        out = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
        out[..., self.ids_tensor] = logits
        return out
