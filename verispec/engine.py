"""The decode loop: prefill, then propose -> verify (one target forward) -> accept -> roll back -> observe.

Plain autoregressive decoding is the same loop with no drafter (every step verifies zero draft tokens),
so the baseline and the speculative path share every line that decides what is emitted.

KV-cache invariant: the target cache holds a prefix of the committed tokens that excludes at least the newest
one (``tokens[-1]``, the *pending* token). A step feeds the uncached committed tokens (normally just the pending
one) and the drafts x_1..x_k in one forward, which yields p_1..p_{k+1}; after verification the cache is cropped
to keep the fed tokens + the accepted drafts, and the correction/bonus token becomes the new pending token.
A *tree* of drafts is fed with a tree attention mask (and verified by ``verify_tree``: greedy or sampled); then every node is cropped and the
accepted path is fed again, in front of the next step's drafts.
"""

from __future__ import annotations

import functools
import secrets
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from .backends.base import (KVCache, TargetModel, TargetModelBase, TargetPass, host_threads, provides_features,
                            torch_threads)
from .controller import COST, Controller, save_cost_curve, shared_cost_curve
from .drafters.base import EMPTY_DRAFT, Draft, Drafter, DrafterBase
from .drafters.ngram import NgramDrafter
from .errors import InvalidRequest, check_whole
from .hidden_states import FeatureBuffer
from .prefix import reusable_prefix
from .sampling import SamplingParams, greedy_tokens, probabilities
from .stats import GenerationStats
from .text import TextAssembler, has_text
from .verify import (ACCEPTANCE_MODES, LOSSY_MODES, STRICT, verify, verify_positional, verify_tree_greedy,
                     verify_tree_positional, verify_typical)

Prompt = str | Sequence[dict] | Sequence[int]


@dataclass
class Generation:
    """Result of one generation. ``token_ids`` are the generated tokens only (an EOS token that ended
    the text is included, as in transformers' ``generate``)."""

    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str
    seed: int
    stats: GenerationStats

    def to_dict(self) -> dict:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "seed": self.seed,
            "stats": self.stats.to_dict(),
        }


@dataclass
class SequenceState:
    """Everything one sequence carries through the loop (one per sequence, so batching can hold many)."""

    tokens: list[int]  # prompt + committed tokens; tokens[-1] is pending (not yet in the cache)
    prompt_len: int
    max_new_tokens: int
    sampling: SamplingParams
    generator: torch.Generator
    text: TextAssembler
    stats: GenerationStats
    cache: KVCache | None  # None until prefill takes a cache (a reused one or a new one)
    cached_tokens: list[int] = field(default_factory=list)  # exactly the tokens whose keys/values are cached
    features: FeatureBuffer = field(default_factory=FeatureBuffer)  # target hidden states of cached_tokens
    finish_reason: str = ""
    seed: int = 0  # the request's: with one-hot drafts, position i's token is drawn with the uniform of (seed, i)
    filler: "NgramDrafter | None" = None  # the prompt lookup that fills padded passes (``SpeculativeDecoder._fill``)

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def cache_is_exact(self) -> bool:
        """The cache holds exactly ``cached_tokens`` (what prefix reuse relies on)."""
        return self.cache is not None and len(self.cache) == len(self.cached_tokens)


@dataclass
class Request:
    """A checked request: prompt ids and options (``SpeculativeDecoder.request``)."""

    ids: list[int]
    sampling: SamplingParams
    max_new_tokens: int
    seed: int
    stops: list[str]
    k: int
    stats: GenerationStats


@dataclass
class StepPlan:
    """A planned step (``SpeculativeDecoder.plan``): what the target pass is fed, and when planning ended."""

    draft: Draft
    uncached: list[int]  # committed tokens not in the cache yet: the pending token, after a tree step its path too
    planned_at: float  # perf_counter() when planning ended (the pass and verification are timed from here)
    proposed: int = -1  # the drafter's tokens at the head of the draft (-1: all); the rest fill the pass's padding
    contended: bool = False  # a program was loading in the background when the pass began (its time is not a cost)

    @property
    def tokens(self) -> list[int]:
        """The target pass's input: the uncached committed tokens, then the draft."""
        return [*self.uncached, *self.draft.tokens]


class GenerationStream:
    """Iterate for text deltas; ``result`` holds the Generation once iteration ends. ``stats`` are the
    live counters, updated after every step (a server reads them while streaming). ``close()`` stops the
    generation early (a client went away)."""

    def __init__(self, steps: Iterator[str], stats: GenerationStats):
        self._steps = steps
        self.stats = stats
        self.result: Generation | None = None

    def __iter__(self) -> Iterator[str]:
        while True:
            try:
                yield next(self._steps)
            except StopIteration as done:
                self.result = done.value
                return

    def close(self) -> None:
        self._steps.close()


class SpeculativeDecoder:
    """Lossless speculative decoding over a target model on any backend (``verispec.backends``).

    ``drafter=None`` is plain decoding through the same loop. ``k`` is the most draft tokens verified per
    step; ``k_policy="cost"`` (the default) lets the controller choose each step how many of them to draft and
    verify, 0 included, from the step costs and acceptance it measures (``verispec.controller``);
    ``k_policy="fixed"`` verifies every draft token the drafter offers, up to k. ``acceptance="typical"``
    switches to LOSSY Medusa-style typical acceptance (off by default and marked lossy in every result). ``reuse_prefix`` keeps the target's KV cache between calls and reuses
    the longest shared prompt prefix. ``fill_padding``: where the target pads a chain's pass anyway (OpenVINO's
    static widths), the padding slots carry more draft tokens from a prompt lookup of the context (n = 1..3) instead
    of copies that nobody reads: free guesses, verified like any one-hot draft, so lossless at any temperature.
    """

    def __init__(
        self,
        target: TargetModel,
        drafter: Drafter | None = None,
        k: int = 8,
        acceptance: str = STRICT,
        typical_epsilon: float = 0.09,
        typical_delta: float = 0.3,
        reuse_prefix: bool = True,
        k_policy: str = COST,
        fill_padding: bool = True,
    ) -> None:
        _check_k(k)
        if not isinstance(target, TargetModelBase):
            raise InvalidRequest(f"{type(target).__name__} is not a verispec target: a backend's model class derives "
                                 "from verispec.backends.base.TargetModelBase (load one with verispec.load_model)")
        if drafter is not None and not isinstance(drafter, DrafterBase):
            raise InvalidRequest(f"{type(drafter).__name__} is not a verispec drafter: drafters derive from "
                                 "verispec.drafters.DrafterBase, which gives the protocol's defaults")
        if acceptance not in ACCEPTANCE_MODES:
            raise InvalidRequest(f"acceptance must be one of {', '.join(ACCEPTANCE_MODES)}, got {acceptance!r}")
        self.target = target
        self.drafter = drafter
        self.k = k
        self.acceptance = acceptance
        self.typical = (typical_epsilon, typical_delta)
        self.reuse_prefix = reuse_prefix
        self._trees = bool(drafter is not None and drafter.tree_depth)  # its caches are asked for tree passes
        # tree passes cost what they cost (a tree may run eagerly where a chain as wide runs compiled, on some
        # backends always): a tree drafter's curve is its own
        curves = functools.partial(shared_cost_curve, target, trees=self._trees)
        self.controller = Controller(curves(), policy=k_policy, source=curves,
                                     flat_cost=drafter is not None and drafter.flat_cost,
                                     stops_early=drafter is not None and drafter.stops_early)
        self._cache: KVCache | None = None
        self._cached_tokens: list[int] = []
        self._features = FeatureBuffer()
        # drafters that read the target's hidden states (EAGLE heads) name the layers; the engine then takes
        # them from the forward passes it runs anyway and hands them to propose()
        self.feature_layers: tuple[int, ...] = tuple(drafter.feature_layers) if drafter is not None else ()
        if self.feature_layers and not provides_features(target, self.feature_layers):
            raise InvalidRequest(f"the {self.drafter_name} drafter reads the target's hidden states at layers "
                                 f"{list(self.feature_layers)}, which this {target.backend} target does not return; "
                                 "use --backend transformers, or on llamacpp load it with features=True")
        self.fill_padding = fill_padding
        if self._trees and not target.supports_trees:
            raise InvalidRequest(f"the {drafter.name} drafter's token trees need a backend that "
                                 f"verifies trees (transformers or openvino; the {target.backend} backend verifies "
                                 "chains only): drop its tree option, pick a chain drafter, or change --backend")
        target.prepare(self.feature_layers, k + 1 if drafter is not None else 1, self._trees)  # e.g. compile graphs

    @property
    def drafter_name(self) -> str:
        return self.drafter.name if self.drafter is not None else "none"

    @property
    def lossy(self) -> bool:
        return self.acceptance in LOSSY_MODES

    # ----------------------------------------------------------------- prompts
    def encode(self, prompt: Prompt, raw: bool = False) -> list[int]:
        """Token ids for a prompt: a string (chat template applied unless ``raw``), a list of chat
        messages, or token ids as they are."""
        tok = self.target.tokenizer
        if isinstance(prompt, str):
            if not has_text(prompt):
                raise InvalidRequest("prompt is empty; pass some text to continue or answer")
            if raw or not tok.chat_template:
                ids = tok(prompt, add_special_tokens=True)["input_ids"]
            else:
                ids = tok.apply_chat_template(
                    [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=True
                )["input_ids"]
        elif isinstance(prompt, Sequence) and prompt and all(isinstance(m, dict) for m in prompt):
            if not tok.chat_template:
                raise InvalidRequest("this tokenizer has no chat template; pass a plain string with raw=True")
            ids = tok.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True, return_dict=True)[
                "input_ids"
            ]
        elif isinstance(prompt, Sequence) and prompt and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
            bad = [t for t in ids if not 0 <= t < self.target.vocab_size]
            if bad:
                raise InvalidRequest(f"token id {bad[0]} is outside the vocabulary [0, {self.target.vocab_size})")
        else:
            raise InvalidRequest("prompt must be a non-empty string, a list of chat messages or a list of token ids")
        if not ids:
            raise InvalidRequest("prompt encodes to no tokens; pass some text")
        return list(ids)

    # ----------------------------------------------------------------- API
    def generate(self, prompt: Prompt, **options) -> Generation:
        """Generate a continuation. Options: max_new_tokens, temperature, top_k, top_p, seed, stop, raw, k."""
        stream = self.stream(prompt, **options)
        for _ in stream:
            pass
        assert stream.result is not None
        return stream.result

    def stream(self, prompt: Prompt, **options) -> GenerationStream:
        """Like ``generate`` but returns a stream of text deltas (errors in the arguments raise here)."""
        request = self.request(prompt, **options)
        return GenerationStream(self._run(request), request.stats)

    def request(
        self,
        prompt: Prompt,
        *,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: Sequence[str] | str | None = None,
        raw: bool = False,
        k: int | None = None,
    ) -> "Request":
        """A checked request for this decoder (the options of ``generate``); raises InvalidRequest on bad ones."""
        sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
        check_whole("max_new_tokens", max_new_tokens)
        if k is not None:
            _check_k(k)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise InvalidRequest(f"seed must be an integer, got {seed!r}")
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if not all(isinstance(s, str) for s in stops):
            raise InvalidRequest("stop must be a string or a list of strings")
        ids = self.encode(prompt, raw=raw)
        limit = self.target.context_length
        if limit is not None and len(ids) >= limit:
            raise InvalidRequest(
                f"the prompt has {len(ids)} tokens but the model's context window is {limit}; shorten the prompt",
                param="prompt", code="context_length_exceeded")
        seed = secrets.randbits(63) if seed is None else seed
        k = self.k if k is None else k
        stats = GenerationStats(
            drafter=self.drafter_name, acceptance=self.acceptance, lossy=self.lossy,
            k=k if self.drafter is not None else 0, prompt_tokens=len(ids),
            k_policy=self.controller.policy if self.drafter is not None else "",
        )
        return Request(ids, sampling, max_new_tokens, seed, stops, k, stats)

    # ----------------------------------------------------------------- loop
    def new_state(self, request: "Request") -> SequenceState:
        """The loop state of a request (no cache yet)."""
        generator = torch.Generator(device=self.target.device)
        generator.manual_seed(request.seed)
        return SequenceState(
            tokens=list(request.ids), prompt_len=len(request.ids), max_new_tokens=request.max_new_tokens,
            sampling=request.sampling, generator=generator,
            text=TextAssembler(self.target.tokenizer, request.stops), stats=request.stats, cache=None,
            seed=request.seed,
        )

    def begin(self, state: SequenceState, k: int, calibrate: bool = True) -> None:
        """After prefill: start the drafter and the controller on this request."""
        if self.drafter is not None:
            self.drafter.reset(state.sampling, state.generator)
            self.controller.start_request(len(state.tokens))
            if calibrate:
                self._calibrate(state, k)

    def advance(self, state: SequenceState, new_tokens: list[int], drafted: int, accepted: int,
                seconds: float) -> str:
        """Commit a step's tokens and count it; returns the text they release."""
        before = len(state.tokens)
        delta = self._commit(state, new_tokens)
        # accepted draft tokens are verify's raw count; committed tokens are what EOS/limits kept
        state.stats.record_step(drafted, accepted, len(state.tokens) - before, seconds)
        return delta

    def result(self, state: SequenceState, request: "Request", start: float) -> Generation:
        """The Generation of a finished (or stopped) sequence."""
        stats = state.stats
        if self.controller.costs:
            stats.plain_step_seconds = self.controller.costs(1)
            save_cost_curve(self.controller.costs)  # for the next process (throttled)
        generated = state.generated
        if state.text.stop_token_count is not None:
            generated = generated[: state.text.stop_token_count]
        stats.new_tokens = len(generated)
        stats.finish_reason = state.finish_reason
        stats.wall_seconds = time.perf_counter() - start
        return Generation(
            text=state.text.emitted, token_ids=generated, prompt_token_ids=list(request.ids),
            finish_reason=state.finish_reason, seed=request.seed, stats=stats,
        )

    @torch.inference_mode()
    def _run(self, request: "Request") -> Iterator[str]:
        start = time.perf_counter()
        state = self.new_state(request)
        k = request.k
        threads = host_threads(self.target)
        with torch_threads(threads):
            self._prefill(state)
            self.begin(state, k)
        try:
            while not state.finish_reason:
                t0 = time.perf_counter()
                with torch_threads(threads):
                    new_tokens, drafted, accepted = self._step(state, k)
                    delta = self.advance(state, new_tokens, drafted, accepted, time.perf_counter() - t0)
                if delta:
                    yield delta
            tail = state.text.finish()
            if tail:
                yield tail
        finally:
            # keep the cache for the next request only if it is exactly what we think it holds
            if self.reuse_prefix and state.cache_is_exact:
                self._cache, self._cached_tokens, self._features = state.cache, state.cached_tokens, state.features
        return self.result(state, request, start)

    def _prefill(self, state: SequenceState) -> None:
        t0 = time.perf_counter()
        ids = state.tokens
        keep = 0
        if self.reuse_prefix and self._cache is not None:
            keep = reusable_prefix(self._cached_tokens, ids, len(self._features) if self.feature_layers else None)
            self._cache.truncate(keep)
            if self.feature_layers:
                self._features.truncate(keep)
                state.features = self._features
            state.cache, state.cached_tokens = self._cache, self._cached_tokens[:keep]
            self._cache = None  # owned by this sequence now
        else:
            state.cache = self.target.new_kv(trees=True) if self._trees else self.target.new_kv()
        state.stats.reused_prompt_tokens = keep
        feed = ids[keep:-1]
        if feed:
            self.prefill_chunk(state, feed)
        state.stats.prefill_seconds = time.perf_counter() - t0

    def prefill_chunk(self, state: SequenceState, chunk: list[int]) -> None:
        """Feed ``chunk``, the prompt's next tokens after ``state.cached_tokens``, and record their hidden states
        for a drafter that reads them. One that reads only a prompt's last rows (``prompt_feature_rows``) gets the
        others prefilled in a pass asking for none, which on llama.cpp would cost every row's logits."""
        layers = self.feature_layers
        rows = self.drafter.prompt_feature_rows if layers else None
        start = len(state.cached_tokens)
        blind = 0 if rows is None else min(len(chunk), max(0, len(state.tokens) - 1 - rows - start))
        if blind:
            self.target.forward(state.cache, chunk[:blind], last_only=True)
            state.features.skip(blind)
        if blind < len(chunk):
            out = self.target.forward(state.cache, chunk[blind:], last_only=True, feature_layers=layers)
            if layers:
                state.features.append(out.hidden)
        state.cached_tokens.extend(chunk)

    def _loading(self) -> bool:
        """Whether the target loads a program in the background now (``TargetModel.programs_loading``)."""
        return self.target.programs_loading

    def _calibrate(self, state: SequenceState, k: int) -> None:
        """Seed the target's cost curve (once per model, pass state and process): time an engine step at the widths
        of 1, 2, 1 + k // 2 and 1 + k that the curve lacks (a stored curve passes on only the widths its process
        confirmed) on this request's context, twice, then crop the cache back (a tree drafter's passes as trees: a
        chain of nodes after the pending tokens). Each width's faster time enters the curve as provisional
        (``CostCurve.seed(..., stored=False)``): the steps confirm or replace it. Nothing is timed while the target
        loads a program that will change its passes (``programs_loading``): ``_step`` calibrates the new curve when
        the program is in, and timing passes that compete with the loader for the cores measured them ~4x dear."""
        curve = self.controller.costs
        known = curve.measured()
        widths = [w for w in sorted({1, 2, 1 + max(1, k // 2), 1 + k}) if w not in known]
        if self.controller.policy != COST or not widths or self._loading():
            return
        start = time.perf_counter()
        past = len(state.cached_tokens)
        pending = state.tokens[past:]
        timed: dict[int, float] = {}
        for i, w in enumerate([1, *widths, *widths]):  # the first pass warms up and is not kept
            feed = (pending * w)[: max(w, len(pending))]
            nodes = len(feed) - len(pending)
            parents = list(range(-1, nodes - 1)) if self._trees and nodes else None
            t0 = time.perf_counter()
            probabilities(self.target.forward(state.cache, feed, parents=parents).logits, state.sampling)
            state.cache.truncate(past)
            if i:  # a pass is only ever slowed down by what else runs: the faster of the two times is the cost
                timed[len(feed)] = min(timed.get(len(feed), float("inf")), time.perf_counter() - t0)
        curve.seed({w: t for w, t in timed.items() if w not in known}, stored=False)
        curve.changed = True
        state.stats.calibration_seconds += time.perf_counter() - start
        save_cost_curve(curve, force=True)

    def _step(self, state: SequenceState, k: int) -> tuple[list[int], int, int]:
        """One propose -> verify -> roll back -> observe step; returns (tokens to commit, draft depth, accepted draft
        tokens). The batch engine runs the same two halves around a pass shared by many sequences."""
        if self.controller.follow_source() and self.drafter is not None:  # a compiled program came in: its curve
            self._calibrate(state, k)
        plan = self.plan(state, k)
        out = self.target.forward(state.cache, plan.tokens, parents=plan.draft.parents,
                                  feature_layers=self.feature_layers)
        return self.settle(state, plan, out)

    def plan(self, state: SequenceState, k: int, alone: bool = True) -> "StepPlan":
        """The first half of a step: choose the budget, propose, choose how much of the draft to verify. The target
        pass over ``plan.tokens`` comes next (alone, or in a batch with other sequences' plans: ``alone=False``,
        whose padding is the batch's, so none is filled)."""
        t0 = time.perf_counter()
        uncached = state.tokens[len(state.cached_tokens):]  # the pending token (after a tree step, the accepted path)
        draft: Draft = EMPTY_DRAFT
        if self.drafter is not None:
            self.controller.follow_source()
            budget, open_ = self._draft_budget(state, k, len(uncached))
            if budget > 0:
                draft = self._propose(state, budget, len(uncached) if open_ else None)
                self.controller.observe_draft(len(draft), time.perf_counter() - t0, draft.catch_up,
                                              draft.catch_up_seconds)
                if draft.parents is None:  # a chain: verify what pays; a tree is verified whole
                    decision = self.controller.verify_length(len(draft), draft.confidence, draft.probs is None,
                                                             len(uncached))
                    draft = draft.truncated(decision.n)
        proposed = len(draft)
        if alone and self.fill_padding and self.drafter is not None and draft.parents is None and draft.probs is None:
            draft = self._fill(state, draft, len(uncached))
        plan = StepPlan(draft, uncached, time.perf_counter(), proposed, self._loading())
        self._record_plan(state, plan, t0)
        return plan

    def settle(self, state: SequenceState, plan: "StepPlan", out: TargetPass,
               shared_pass_seconds: float | None = None) -> tuple[list[int], int, int]:
        """The second half of a step, after the target pass: verify, roll back, observe; returns (tokens to commit,
        draft depth, accepted draft tokens). A pass shared with other sequences (``verispec.batching``) gives its
        time in ``shared_pass_seconds``; the batch records its cost, not this sequence."""
        draft, uncached = plan.draft, plan.uncached
        proposed = len(draft) if plan.proposed < 0 else min(plan.proposed, len(draft))
        past = len(state.cached_tokens)
        rows = out.logits[len(uncached) - 1 :]  # [k+1, vocab]: after the pending token, after each draft token
        if state.sampling.greedy and draft.probs is None and (self.acceptance == STRICT or draft.parents is not None):
            # greedy one-hot verification (chains, trees) reads only the target's argmax: no one-hot rows are built
            p = greedy_tokens(rows)
        else:
            p = probabilities(rows, state.sampling)
        if draft.parents is not None:
            path, next_token = self._verify_tree(state, draft, p)
            n, accepted = len(path), [draft.tokens[i] for i in path]
            kept_rows = list(range(len(uncached))) + [len(uncached) + i for i in path]
            # the accepted nodes' keys sit between rejected siblings: move them to follow the committed tokens
            # where the cache can (KVCache.keep), else drop every node and feed the path again with the next pass
            if state.cache.keeps_positions:
                start = past + len(uncached)
                state.cache.keep(start, [start + i for i in path])
                state.cached_tokens.extend([*uncached, *accepted])
            else:
                self._keep(state, past, uncached, [])
        else:
            n, next_token = self._verify_chain(state, draft, p)
            accepted = draft.tokens[:n]
            kept_rows = list(range(len(uncached) + n))
            self._keep(state, past, uncached, accepted)
        if self.feature_layers:
            # hidden states of every committed token but the new pending one, from this same forward; rows of
            # tokens fed again after a tree step are already recorded
            rows = out.hidden[kept_rows]
            state.features.append(rows[len(state.features) - past :])
        if proposed < len(draft):  # filled padding: counted apart, so the drafter's own figures stay its own
            state.stats.filled += len(draft) - proposed
            state.stats.filled_accepted += max(0, n - proposed)
            n_own, draft = min(n, proposed), draft.truncated(proposed)
        else:
            n_own = n
        if self.drafter is not None and len(draft):
            self.drafter.observe(n_own)
            self.drafter.observe_logits(out.logits[len(uncached) - 1 :])  # drafters that learn from it (lookahead)
        self._record_settle(state, plan, n_own, shared_pass_seconds, draft)
        return [*accepted, next_token], draft.depth, n_own

    # ----------------------------------------------------------------- the step's parts
    def _draft_budget(self, state: SequenceState, k: int, uncached: int) -> tuple[int, bool]:
        """(Draft tokens to ask for, whether the drafter may stop before them): at most k, what the output and the
        context window still hold, and what the controller finds worth a wider pass (0 = a plain step)."""
        k = max(0, min(k, self._draft_room(state)))
        open_ = False
        if k > 0:
            decision = self.controller.draft_budget(k, uncached, self.drafter.tree_depth)
            k, open_ = decision.n, decision.open
        state.stats.step_budget.append(k)
        return k, open_

    def _draft_room(self, state: SequenceState) -> int:
        """Draft tokens the sequence can still take: the output's limit (the step commits one more) and the context
        window's."""
        remaining = state.max_new_tokens - len(state.generated)
        room = (self.target.context_length or 1 << 30) - len(state.tokens)
        return min(remaining - 1, room)

    def _fill(self, state: SequenceState, draft: Draft, uncached: int) -> Draft:
        """``draft`` extended into the slots the target pads the pass with anyway (``pass_width``), by what followed
        the latest earlier occurrence of the context-and-draft's last 3, 2 or 1 tokens; as it was where none are."""
        fed = uncached + len(draft)
        free = self.target.pass_width([fed]) - fed
        if free <= 0:
            return draft
        free = min(free, self._draft_room(state) - len(draft))
        if free <= 0:
            return draft
        if state.filler is None:
            state.filler = NgramDrafter(min_n=1, max_n=3)
        extra = state.filler.follow(state.tokens, draft.tokens, free)
        if not extra:
            return draft
        confidence = None if draft.confidence is None else [*draft.confidence, *[0.0] * len(extra)]
        return Draft([*draft.tokens, *extra], None, None, confidence)

    def _propose(self, state: SequenceState, k: int, fed: int | None = None) -> Draft:
        """The drafter's proposal of up to k tokens; with ``fed`` (the pass's committed tokens), a drafter that stops
        early ends it where the controller's ``draft_more`` says another token would not pay."""
        extra = {}
        if self.feature_layers:
            extra["features"] = state.features.view()
        if fed is not None:
            extra["enough"] = lambda confidence: not self.controller.draft_more(confidence, k, fed)
        draft = self.drafter.propose(state.tokens, k, **extra)
        draft = draft.truncated(k) if len(draft) > k else draft
        # a token the target has no row for cannot be accepted, and no engine takes it (llama.cpp refuses the batch,
        # an embedding raises): the draft ends before it. The process's suffix store holds every model's sequences,
        # so a second model in one process can be drafted another vocabulary's ids (a test run met it: a Gemma 3 id
        # drafted for a 49,152-token model).
        vocab = self.target.vocab_size
        bad = next((i for i, t in enumerate(draft.tokens) if not 0 <= t < vocab), None)
        return draft if bad is None else draft.truncated(bad)

    def _verify_chain(self, state: SequenceState, draft: Draft, p: torch.Tensor | list[int]) -> tuple[int, int]:
        """(accepted draft tokens, correction or bonus token) by the acceptance rule (strict unless lossy is asked).
        ``p``: the target's distributions, or for greedy one-hot drafts its argmax at each row (``settle``)."""
        if self.acceptance == STRICT and draft.probs is None:  # plain steps and one-hot drafts
            if state.sampling.greedy:  # p is the argmax of each row: accept while the draft is the argmax
                n = next((i for i, x in enumerate(draft.tokens) if x != p[i]), len(draft.tokens))
                return n, p[n]
            verdict = verify_positional(draft.tokens, p, state.seed, len(state.tokens))  # position-keyed draws
            return verdict.num_accepted, verdict.next_token
        x = torch.tensor(draft.tokens, dtype=torch.long, device=self.target.device)  # [k]
        if self.acceptance == STRICT:
            verdict = verify(x, draft.probs.to(self.target.device), p, state.generator)
        else:
            verdict = verify_typical(x, p, state.generator, *self.typical)
        return verdict.num_accepted, verdict.next_token

    def _verify_tree(self, state: SequenceState, draft: Draft, p: torch.Tensor | list[int]) -> tuple[list[int], int]:
        """(accepted path of node indices, correction or bonus token) for a tree of deterministic candidates; ``p``
        as for ``_verify_chain``."""
        if state.sampling.greedy:
            return verify_tree_greedy(draft.tokens, draft.parents, p)
        return verify_tree_positional(draft.tokens, draft.parents, p, state.seed, len(state.tokens))

    @staticmethod
    def _keep(state: SequenceState, past: int, uncached: list[int], accepted: list[int]) -> None:
        """Roll the cache back to the committed tokens fed and the accepted drafts."""
        state.cache.truncate(past + len(uncached) + len(accepted))
        state.cached_tokens.extend([*uncached, *accepted])

    def _record_plan(self, state: SequenceState, plan: "StepPlan", t0: float) -> None:
        """Statistics and the controller's predictions for a planned step."""
        ctrl, draft = self.controller, plan.draft
        if self.drafter is not None and ctrl.active:
            state.stats.probes += ctrl.state.probe_pending and len(draft) > 0
            chain_confidence = draft.confidence if draft.parents is None else None
            state.stats.predicted_tokens += ctrl.predicted_tokens(draft.depth, chain_confidence)
            state.stats.predicted_seconds += (plan.planned_at - t0) + ctrl.costs(len(plan.uncached) + len(draft))
        state.stats.draft_seconds += plan.planned_at - t0

    def _record_settle(self, state: SequenceState, plan: "StepPlan", accepted: int,
                       shared_pass_seconds: float | None, draft: Draft) -> None:
        """What the controller learns from a settled step (the pass's cost, the verdict on the drafter's own
        ``draft``), and its statistics."""
        seconds = time.perf_counter() - plan.planned_at
        # a pass timed while a program loads in the background shared the cores with the loader (~4x dear on 2):
        # not what passes cost, in this curve or the next process's
        if shared_pass_seconds is None and not (plan.contended or self._loading()):
            self.controller.observe_step(len(plan.tokens), seconds)
        if self.drafter is not None:
            self.controller.observe_verdict(draft.depth, accepted, draft.confidence)
        state.stats.verify_seconds += seconds if shared_pass_seconds is None else shared_pass_seconds

    def _commit(self, state: SequenceState, new_tokens: list[int]) -> str:
        """Append tokens, apply EOS / length / context stops; return the text they release."""
        eos = self.target.eos_token_ids
        for i, token in enumerate(new_tokens):
            if token in eos:
                new_tokens = new_tokens[: i + 1]
                state.finish_reason = "stop"
                break
        remaining = state.max_new_tokens - len(state.generated)
        if len(new_tokens) >= remaining:
            new_tokens = new_tokens[:remaining]
            state.finish_reason = state.finish_reason or "length"
        state.tokens.extend(new_tokens)
        limit = self.target.context_length
        if limit is not None and len(state.tokens) >= limit:
            state.finish_reason = state.finish_reason or "length"
        delta = state.text.add(new_tokens)
        if state.text.stopped:
            state.finish_reason = "stop"
        return delta


def _check_k(k) -> None:
    check_whole("k (draft tokens per step)", k)
