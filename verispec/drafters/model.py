"""A separate, smaller causal LM that shares the target's tokenizer drafts k tokens autoregressively."""

from __future__ import annotations

from typing import Sequence

import torch

from ..backends.base import TargetModel
from ..compat import check_compatible
from ..prefix import common_prefix_length
from ..sampling import SamplingParams, probabilities, sample
from .base import Draft, DrafterBase
from .registry import DrafterSpec, register


class ModelDrafter(DrafterBase):
    """Samples each draft token from the draft model with the request's sampling parameters and
    returns q. Its KV cache holds every token it has seen except the newest; on the next proposal it
    keeps the longest prefix shared with the committed context (dropping rejected drafts) and feeds
    only the rest."""

    name = "model"

    def __init__(self, draft: TargetModel, target: TargetModel | None = None, *, check_chat_template: bool = True):
        if target is not None:
            check_compatible(target.tokenizer, draft.tokenizer, check_chat_template=check_chat_template)
        self.draft = draft
        self.vocab_size = target.vocab_size if target is not None else draft.vocab_size
        self.reset(SamplingParams(), None)

    def reset(self, sampling: SamplingParams, generator: torch.Generator | None) -> None:
        self.sampling = sampling
        self.generator = generator
        self._cache = None  # the draft's KV cache, made at the first proposal
        self._cached: list[int] = []  # tokens whose keys/values are in _cache

    def _distribution(self, logits: torch.Tensor) -> torch.Tensor:
        # the draft may only propose ids the target can score; pad q when the target's vocabulary is wider
        logits = logits[..., : self.vocab_size]
        q = probabilities(logits, self.sampling)
        if q.shape[-1] < self.vocab_size:
            q = torch.nn.functional.pad(q, (0, self.vocab_size - q.shape[-1]))
        return q

    @torch.inference_mode()
    def propose(self, context: Sequence[int], k: int) -> Draft:
        if self._cache is None:
            self._cache = self.draft.new_kv()
        keep = min(common_prefix_length(self._cached, context), len(context) - 1)
        self._cache.truncate(keep)
        del self._cached[keep:]
        feed = list(context[keep:])
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        confidence: list[float] = []
        for _ in range(k):
            logits = self.draft.forward(self._cache, feed, last_only=True).logits[-1]
            self._cached.extend(feed)
            q = self._distribution(logits)  # [vocab]
            # the draft model's largest probability (of the distribution, not of the token drawn from it)
            confidence.append(float(torch.softmax(logits.float(), dim=-1).max()))
            token = sample(q, self.generator)
            tokens.append(token)
            probs.append(q)
            feed = [token]
        return Draft(tokens, torch.stack(probs) if probs else None, confidence=confidence)
    # observe(): nothing to learn; the next propose() realigns the cache with the committed context


register(DrafterSpec(
    "model", "a separate, smaller model with the target's tokenizer drafts token by token",
    lambda target, draft_model, **options: ModelDrafter(draft_model, target, **options),
    needs_draft_model=True,
))
