"""A separate, smaller causal LM drafts k tokens autoregressively: with the target's tokenizer as token ids and
sampled q, with another tokenizer as text (``retokenize``)."""

from __future__ import annotations

import threading
import time
from typing import Sequence

import torch

from ..backends.base import TargetModel
from ..compat import check_compatible, different_vocabulary
from ..errors import IncompatibleDrafter
from ..prefix import common_prefix_length
from ..sampling import SamplingParams, probabilities, sample
from .base import Draft, DrafterBase
from .registry import DrafterSpec, Option, register
from .retokenize import RetokenizingDrafter


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
        feed = self._realign(context)
        catch_up, catch_up_seconds = self._catch_up(feed)
        tokens, probs, confidence = self._draft(feed[catch_up:], k, self.generator)
        return Draft(tokens, torch.stack(probs) if probs else None, confidence=confidence, catch_up=catch_up,
                     catch_up_seconds=catch_up_seconds)

    def _realign(self, context: Sequence[int]) -> list[int]:
        """Keep the longest prefix of the cache shared with ``context`` (dropping rejected drafts); the tokens of
        ``context`` the draft has still to read."""
        if self._cache is None:
            self._cache = self.draft.new_kv()
        keep = min(common_prefix_length(self._cached, context), len(context) - 1)
        self._cache.truncate(keep)
        del self._cached[keep:]
        return list(context[keep:])

    def _draft(self, feed: list[int], k: int, generator: torch.Generator | None,
               stop: threading.Event | None = None) -> tuple[list[int], list[torch.Tensor], list[float]]:
        """Up to k tokens sampled one at a time after reading ``feed``; every token but the last is read into the
        cache. ``stop`` (set by another thread) ends the loop after the current pass."""
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        confidence: list[float] = []
        for _ in range(k):
            if stop is not None and stop.is_set():
                break
            logits = self.draft.forward(self._cache, feed, last_only=True).logits[-1]
            self._cached.extend(feed)
            q = self._distribution(logits)  # [vocab]
            # the draft model's largest probability (of the distribution, not of the token drawn from it)
            confidence.append(float(torch.softmax(logits.float(), dim=-1).max()))
            token = sample(q, generator)
            tokens.append(token)
            probs.append(q)
            feed = [token]
        return tokens, probs, confidence

    # observe(): nothing to learn; the next propose() realigns the cache with the committed context

    def _catch_up(self, feed: list[int]) -> tuple[int, float]:
        """Read all but the newest of ``feed`` in one pass of their own when there are more than a step leaves (the
        accepted last draft token and the target's next one): the tokens committed by plain steps since the last
        proposal, or the prompt. Returns (tokens read, seconds), which the controller keeps apart from the cost of
        a draft token."""
        if len(feed) <= 2:
            return 0, 0.0
        start = time.perf_counter()
        self.draft.forward(self._cache, feed[:-1], last_only=True)
        self._cached.extend(feed[:-1])
        return len(feed) - 1, time.perf_counter() - start


def build_model_drafter(target: TargetModel | None, draft: TargetModel, retokenize: str = "auto",
                        check_chat_template: bool = True, parallel: bool = False) -> DrafterBase:
    """A ``ModelDrafter`` when the draft shares the target's tokens, a ``RetokenizingDrafter`` when it does not
    (``retokenize`` auto), or as asked (on: always through text; off: refuse another tokenizer). ``parallel``: the
    next proposal is drafted while the target verifies (``verispec.drafters.ahead``)."""
    difference = None if target is None else different_vocabulary(target.tokenizer, draft.tokenizer)
    if retokenize == "on" or (retokenize == "auto" and difference is not None):
        if target is None:
            raise IncompatibleDrafter("a draft model with another tokenizer needs the target to translate to")
        if parallel:
            raise IncompatibleDrafter(f"--model-parallel drafts with a draft model that shares the target's tokenizer; "
                                      f"this one drafts through text ({difference or 'retokenize on'}): leave "
                                      "--model-parallel off")
        return RetokenizingDrafter(draft, target)
    if difference is not None:
        raise IncompatibleDrafter(f"{difference}. With --model-retokenize off a draft model must share the target's "
                                  "tokenizer; leave it at auto to draft through text (greedy drafts, lossless at any "
                                  "temperature)")
    if parallel:
        from .ahead import ParallelModelDrafter

        return ParallelModelDrafter(draft, target, check_chat_template=check_chat_template)
    return ModelDrafter(draft, target, check_chat_template=check_chat_template)


register(DrafterSpec(
    "model", "a separate, smaller model drafts token by token (another tokenizer: through text, greedy drafts)",
    lambda target, draft_model, **options: build_model_drafter(target, draft_model, **options),
    options=(Option("retokenize", str, "auto", "how --drafter model bridges tokenizers: auto (through text when the "
                    "draft's tokenizer differs from the target's), on (always through text), off (refuse another "
                    "tokenizer) (default: auto)", choices=("auto", "on", "off"), metavar="MODE"),
             Option("parallel", bool, False, "--drafter model drafts its next proposal on a thread of its own while "
                    "the target verifies this one (draft || verify; lossless; a draft sharing the target's tokenizer; "
                    "docs/draft-models.md) (default: off)"),),
    needs_draft_model=True,
))
