"""A separate, smaller causal LM drafts k tokens autoregressively: with the target's tokenizer as token ids and
sampled q (also while the target verifies: ``ParallelModelDrafter``), with another tokenizer as text
(``retokenize``)."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..backends.base import TargetModel
from ..compat import check_compatible, different_vocabulary
from ..errors import IncompatibleDrafter
from ..prefix import common_prefix_length
from ..sampling import SamplingParams, probabilities, sample
from .base import Draft, DrafterBase
from .registry import DrafterSpec, Option, register
from .retokenize import RetokenizingDrafter

log = logging.getLogger(__name__)


class ModelDrafter(DrafterBase):
    """Samples each draft token from the draft model with the request's sampling parameters and
    returns q. Its KV cache holds every token it has seen except the newest; on the next proposal it
    keeps the longest prefix shared with the committed context (dropping rejected drafts, or what another
    request left after the prompt they share) and feeds only the rest."""

    name = "model"
    stops_early = True  # each draft token costs a pass of the draft model: stop where another would not pay

    def __init__(self, draft: TargetModel, target: TargetModel | None = None, *, check_chat_template: bool = True):
        if target is not None:
            check_compatible(target.tokenizer, draft.tokenizer, check_chat_template=check_chat_template)
        self.draft = draft
        self.vocab_size = target.vocab_size if target is not None else draft.vocab_size
        self._cache = None  # the draft's KV cache, made at the first proposal and kept across requests
        self._cached: list[int] = []  # tokens whose keys/values are in _cache
        self.reset(SamplingParams(), None)

    def reset(self, sampling: SamplingParams, generator: torch.Generator | None) -> None:
        """A new request. The draft's cache stays: the next proposal keeps the prefix it shares with the request's
        context (``_realign``), so a repeated prompt, a conversation's next turn or an audit's next sample is not
        read again (its keys and values depend on the tokens alone)."""
        self.sampling = sampling
        self.generator = generator

    def _distribution(self, logits: torch.Tensor) -> torch.Tensor:
        # the draft may only propose ids the target can score; pad q when the target's vocabulary is wider
        logits = logits[..., : self.vocab_size]
        q = probabilities(logits, self.sampling)
        if q.shape[-1] < self.vocab_size:
            q = torch.nn.functional.pad(q, (0, self.vocab_size - q.shape[-1]))
        return q

    @torch.inference_mode()
    def propose(self, context: Sequence[int], k: int,
                enough: Callable[[list[float]], bool] | None = None) -> Draft:
        """Up to ``k`` tokens; ``enough``, if given, is asked after each with the confidences so far and ends the
        draft when it says so (the controller's stopping rule: it reads the confidences, never the drawn tokens)."""
        feed = self._realign(context)
        catch_up, catch_up_seconds = self._catch_up(feed)
        tokens, probs, confidence = self._draft(feed[catch_up:], k, self.generator, enough=enough)
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
               stop: threading.Event | None = None, enough: Callable[[list[float]], bool] | None = None,
               ) -> tuple[list[int], list[torch.Tensor], list[float]]:
        """Up to k tokens sampled one at a time after reading ``feed``; every token but the last is read into the
        cache. ``stop`` (set by another thread) ends the loop after the current pass; ``enough(confidences)`` after
        a token when it returns True."""
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        confidence: list[float] = []
        for _ in range(k):
            if stop is not None and stop.is_set():
                break
            logits = self._forward(feed)
            self._cached.extend(feed)
            q = self._distribution(logits)  # [vocab]
            # the draft model's largest probability (of the distribution, not of the token drawn from it)
            confidence.append(float(torch.softmax(logits.float(), dim=-1).max()))
            token = sample(q, generator)
            tokens.append(token)
            probs.append(q)
            feed = [token]
            if enough is not None and len(tokens) < k and enough(confidence):
                break
        return tokens, probs, confidence

    # observe(): nothing to learn; the next propose() realigns the cache with the committed context

    def _forward(self, feed: list[int]) -> torch.Tensor:
        """The draft's logits after reading ``feed`` into its cache."""
        return self.draft.forward(self._cache, feed, last_only=True).logits[-1]

    def _catch_up(self, feed: list[int]) -> tuple[int, float]:
        """Read all but the newest of ``feed`` in one pass of their own when there are more than a step leaves (the
        accepted last draft token and the target's next one): the tokens committed by plain steps since the last
        proposal, or the prompt. Returns (tokens read, seconds), which the controller keeps apart from the cost of
        a draft token."""
        if len(feed) <= 2:
            return 0, 0.0
        start = time.perf_counter()
        self._forward(feed[:-1])
        self._cached.extend(feed[:-1])
        return len(feed) - 1, time.perf_counter() - start


# ----------------------------------------------------------------------------- drafting while the target verifies
_LOCKS_GUARD = threading.Lock()


def _forward_lock(model) -> threading.Lock:
    """One lock per draft model object, for the passes of the drafters that run it from several threads."""
    with _LOCKS_GUARD:
        lock = model.__dict__.get("_verispec_forward_lock")
        if lock is None:
            lock = model.__dict__["_verispec_forward_lock"] = threading.Lock()
        return lock


@dataclass
class _Ahead:
    context: list[int]  # the committed context the proposal below was drafted for
    tokens: list[int]
    probs: list[torch.Tensor]
    confidence: list[float]


class ParallelModelDrafter(ModelDrafter):
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

    Threads: the worker and the target's pass run at once, each on the threads its backend was loaded with (``--threads``
    for both). On a 2-core CPU the two then share the cores and this loses to sequential drafting (docs/draft-models.md).

    ``hits`` / ``misses``: proposals taken from the worker / dropped."""

    stops_early = False  # the worker drafts the next proposal whole, before the step that would cut it

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

    def _forward(self, feed: list[int]) -> torch.Tensor:
        # a server's slots share one draft model, and a llama.cpp context or an OpenVINO infer request runs one pass
        # at a time: this drafter's worker and the other slots' drafting take turns on it
        with _forward_lock(self.draft):
            return super()._forward(feed)

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
        # not a daemon: a command that returns while the last worker drafts waits for it (a daemon thread killed inside
        # a torch call at exit aborts the process)
        self._worker = threading.Thread(target=self._work, args=(optimistic, k, generator), daemon=False,
                                        name="verispec-draft-ahead")
        self._worker.start()

    @torch.inference_mode()
    def _work(self, optimistic: list[int], k: int, generator: torch.Generator | None) -> None:
        try:
            logits = self._forward(optimistic[-1:])
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


def build_model_drafter(target: TargetModel | None, draft: TargetModel, retokenize: str = "auto",
                        check_chat_template: bool = True, parallel: bool = False) -> DrafterBase:
    """A ``ModelDrafter`` when the draft shares the target's tokens, a ``RetokenizingDrafter`` when it does not
    (``retokenize`` auto), or as asked (on: always through text; off: refuse another tokenizer). ``parallel``: the
    next proposal is drafted while the target verifies (``ParallelModelDrafter``)."""
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
