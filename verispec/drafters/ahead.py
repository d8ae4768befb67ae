"""Draft while the target verifies (``--model-parallel``): a draft model's next proposal is drafted on a thread of
its own during the target's pass, from the continuation the pass would give if every draft token were accepted.

After each proposal of d_1..d_k a worker thread reads d_k into the draft's cache, takes the draft's most likely next
token g as a guess of the target's bonus token, and drafts e_1..e_k after it (PEARL's "post-verify", Mirror-SD's
draft ‖ verify). If the target accepts all of d and its bonus token is g, the committed context is exactly the one
the worker drafted for, and e is the next proposal at no wait; otherwise the worker is stopped and its tokens are
dropped, and the draft realigns its cache as a sequential draft does.

Lossless by construction: verification is unchanged, and a proposal used is drawn from the draft's distribution given
the committed context (the worker's context is compared token for token), with that distribution returned as q.
Sampling stays reproducible with a seed: each worker draws from a generator seeded from the request's own seed and
the proposal's number, and a proposal the next step uses is always drafted to its full length (the wait, if any, is
draft work a sequential draft would do anyway), so how far a worker got never changes a token.

Threads: the worker and the target's pass run at once, each on the threads its backend was loaded with; on a 2-core
machine the draft model is best loaded with one (``--draft-threads 1``), measured in docs/draft-models.md.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Sequence

import torch

from ..backends.base import TargetModel
from ..sampling import SamplingParams
from .base import Draft
from .model import ModelDrafter

log = logging.getLogger(__name__)


@dataclass
class _Ahead:
    context: list[int]  # the committed context the proposal below was drafted for
    tokens: list[int]
    probs: list[torch.Tensor]
    confidence: list[float]


class ParallelModelDrafter(ModelDrafter):
    """A ``ModelDrafter`` whose next proposal is drafted during the target's pass (see the module docstring).
    ``hits`` / ``misses``: proposals taken from the worker / dropped."""

    def __init__(self, draft: TargetModel, target: TargetModel | None = None, *, check_chat_template: bool = True):
        self._worker: threading.Thread | None = None
        self._stop = threading.Event()
        self._guessed = threading.Event()  # set once the worker has its guess of the target's next token
        self._optimistic: list[int] = []  # the context the worker drafts after, before its guess
        self._guess = -1
        self._ahead: _Ahead | None = None
        self._failure: BaseException | None = None
        self.hits = self.misses = 0
        super().__init__(draft, target, check_chat_template=check_chat_template)

    def reset(self, sampling: SamplingParams, generator: torch.Generator | None) -> None:
        self._join(stop=True)
        super().reset(sampling, generator)
        # the worker's own generator, seeded per proposal from this request's stream (never shared across threads)
        self._seed = None if generator is None else int(torch.randint(1 << 62, (1,), generator=generator))
        self._proposals = 0

    @torch.inference_mode()
    def propose(self, context: Sequence[int], k: int) -> Draft:
        context = list(context)
        draft = None
        if self._worker is not None:
            hit = len(context) == len(self._optimistic) + 1 and context[:-1] == self._optimistic
            if hit:  # every draft token was accepted: was the target's next token the worker's guess?
                self._guessed.wait()
                hit = context[-1] == self._guess
            ahead = self._join(stop=not hit)  # a worker drafting for another context stops after its current pass
            if hit and ahead is not None and ahead.tokens:
                self.hits += 1
                draft = self._use(ahead, k)
            else:
                self.misses += 1
        if draft is None:
            draft = super().propose(context, k)
        if draft.tokens:
            self._start(context + draft.tokens, len(draft.tokens))
        return draft

    def _use(self, ahead: _Ahead, k: int) -> Draft:
        """The worker's proposal cut to k tokens, or drafted on to k; the cache left as ``propose`` leaves it (every
        proposed token read but the last)."""
        n = min(k, len(ahead.tokens))
        tokens, probs, confidence = ahead.tokens[:n], ahead.probs[:n], ahead.confidence[:n]
        keep = len(ahead.context) + n - 1
        self._cache.truncate(keep)
        del self._cached[keep:]
        if n < k:
            more, more_probs, more_confidence = self._draft([tokens[-1]], k - n, self.generator)
            tokens, probs, confidence = tokens + more, probs + more_probs, confidence + more_confidence
        return Draft(tokens, torch.stack(probs), confidence=confidence)

    def _start(self, optimistic: list[int], k: int) -> None:
        """Draft k tokens after ``optimistic`` (the context with every proposed token accepted) plus the draft's
        guess of the target's next token, on the worker thread."""
        self._proposals += 1
        generator = None
        if self._seed is not None:
            generator = torch.Generator().manual_seed((self._seed + self._proposals) % (1 << 63))
        self._stop.clear()
        self._guessed.clear()
        self._optimistic, self._guess, self._ahead, self._failure = optimistic, -1, None, None
        self._worker = threading.Thread(target=self._work, args=(optimistic, k, generator), daemon=True,
                                        name="verispec-draft-ahead")
        self._worker.start()

    @torch.inference_mode()
    def _work(self, optimistic: list[int], k: int, generator: torch.Generator | None) -> None:
        try:
            logits = self.draft.forward(self._cache, optimistic[-1:], last_only=True).logits[-1]
            self._cached.append(optimistic[-1])
            self._guess = int(torch.argmax(logits[: self.vocab_size]))
            self._guessed.set()
            tokens, probs, confidence = self._draft([self._guess], k, generator, self._stop)
            self._ahead = _Ahead([*optimistic, self._guess], tokens, probs, confidence)
        except BaseException as exc:  # raised again in the caller's thread by _join
            self._failure = exc
        finally:
            self._guessed.set()

    def _join(self, stop: bool) -> _Ahead | None:
        """Wait for the worker (told to stop first with ``stop``); what it drafted, None when stopped."""
        if self._worker is None:
            return None
        if stop:
            self._stop.set()
        self._worker.join()
        self._worker = None
        ahead, self._ahead = self._ahead, None
        failure, self._failure = self._failure, None
        if failure is not None:
            if not isinstance(failure, Exception):
                raise failure
            # drafting past what the committed context needs can fail where a sequential draft would not (the
            # draft's context window): that proposal is dropped, and the next one is drafted in the caller's thread
            log.warning("drafting ahead failed (%s: %s); drafting this step sequentially",
                        type(failure).__name__, failure)
            return None
        return None if stop else ahead
