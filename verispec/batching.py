"""Continuous batching: many sequences share each target pass, each with its own drafter, sampling and seed.

A step: every decoding sequence *plans* (its drafter proposes, its controller decides how much to verify, seeing
the cost of the shared pass), one ``forward_batch`` feeds every sequence's pending token and draft (ragged: 0
draft tokens included), and every sequence *settles* (strict acceptance with its own generator, rollback of its
own cache only) and commits. Planning and settling are ``SpeculativeDecoder``'s own halves of a step, so a
batched sequence runs exactly the code a lone one runs; only the pass is shared.

Sequences join and leave between steps. Joining prompts are prefilled ``prefill_chunk`` tokens a step in all while
others are decoding (in arrival order: short prompts several a step, a long one in chunks; the first whole when
nobody is waiting), so prompts delay running streams by at most one chunk's tokens a step. A joining prompt that
starts like a cached sequence (a live one, or a finished one: their caches are kept while their rows are not needed,
the last one only on llama.cpp, whose sequences share one window, and copied out into memory when their rows are,
up to ``prompt_cache_bytes``) takes that prefix's keys and values instead of
computing them (``KVGroup.copy_prefix``; the lone decoder's prompt-prefix reuse, across sequences), so a shared
system prompt is prefilled once. Speculation adapts to load: each sequence's controller sees the pass as the whole
batch's (``Controller.share_passes``), so drafts are verified only where they raise the batch's tokens per second;
with many sequences speculation shrinks or stops by itself, with one it runs as it would alone.

Thread use: ``submit`` and ``cancel`` may be called from any thread; ``step`` (or ``run``) from one thread.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from .backends.base import KVCache, TargetModel, TargetPass, host_threads, torch_threads
from .controller import COST, save_cost_curve, shared_cost_curve
from .engine import Generation, Request, SequenceState, SpeculativeDecoder, StepPlan
from .errors import InvalidRequest, check_whole
from .hidden_states import FeatureBuffer
from .prefix import reusable_prefix

log = logging.getLogger(__name__)

DEFAULT_MAX_BATCH = 8
DEFAULT_PREFILL_CHUNK = 128
# finished prompts' keys and values kept in memory past their rows (serve --prompt-cache-mb)
DEFAULT_PROMPT_CACHE_MB = 1024
DEFAULT_PROMPT_CACHE_BYTES = DEFAULT_PROMPT_CACHE_MB << 20
CAP_MARGIN = 0.03  # a padded batch changes its shared draft cap only for a predicted gain of more than this


@dataclass
class BatchedSequence:
    """One request inside the batch; ``result`` is set when it finishes, ``error`` if it failed."""

    decoder: SpeculativeDecoder
    request: Request
    on_delta: Callable[[str], None] | None = None
    on_done: Callable[["BatchedSequence"], None] | None = None
    state: SequenceState | None = None
    start: float = field(default_factory=time.perf_counter)
    cancelled: bool = False
    result: Generation | None = None
    error: BaseException | None = None
    width: int = 1  # tokens it fed to the last pass
    committed: float = 1.0  # tokens it committed with the last pass


@dataclass
class _Cached:
    """A cache a joining prompt may copy its prefix from: exactly ``tokens`` are cached, with their hidden states
    at ``layers`` in ``features`` when a drafter asked for them."""

    tokens: list[int]
    cache: KVCache
    features: FeatureBuffer
    layers: tuple[int, ...]

    @classmethod
    def of(cls, seq: "BatchedSequence") -> "_Cached | None":
        """What ``seq``'s cache holds, or None when it has no cache or one that does not match its tokens."""
        state = seq.state
        if state is None or not state.cache_is_exact:
            return None
        return cls(state.cached_tokens, state.cache, state.features, seq.decoder.feature_layers)


@dataclass(eq=False)
class _Stored:
    """A finished sequence's cache copied out of its row when the row was needed (``KVGroup.snapshot``), so a
    joining prompt can still take its prefix (``KVGroup.restore``): llama-server's host prompt cache, in kind.
    Never for drafters that read hidden states (``layers`` stays empty)."""

    tokens: list[int]
    snapshot: object
    nbytes: int
    layers: tuple[int, ...] = ()


@dataclass
class BatchCounters:
    """Raw counters of the batched passes (rates are derived by whoever reads them)."""

    passes: int = 0
    sequences: int = 0  # summed over passes: sequences decoding in them
    tokens: int = 0  # summed over passes: tokens fed (pending + drafts)
    computed: int = 0  # summed over passes: tokens computed, padding included
    speculating: int = 0  # summed over passes: sequences that verified at least one draft token
    prefill_passes: int = 0
    prefill_tokens: int = 0
    reused_prompt_tokens: int = 0  # prompt tokens taken from another sequence's cache instead of prefilled
    seconds: float = 0.0  # in decode passes


class BatchEngine:
    """Runs many ``SpeculativeDecoder`` requests together over one target (see the module docstring).

    Each submitted sequence brings its own decoder (its drafter and controller carry per-sequence state), so a
    decoder serves one sequence at a time; the target and its weights are shared."""

    def __init__(self, target: TargetModel, max_batch: int = DEFAULT_MAX_BATCH,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, reuse_prefix: bool = True,
                 prompt_cache_bytes: int = DEFAULT_PROMPT_CACHE_BYTES) -> None:
        """``reuse_prefix``: a joining prompt copies the longest prefix it shares with a cached sequence (live, or
        finished) instead of prefilling it; a decoder built with ``reuse_prefix=False`` never does.
        ``prompt_cache_bytes``: how much memory finished caches may keep once their rows are needed (copied out,
        the oldest dropped first; 0: none), where the backend's group can copy rows out (transformers, blocks)."""
        check_whole("max batch", max_batch)
        check_whole("prefill chunk", prefill_chunk)
        self.target = target
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self.reuse_prefix = reuse_prefix
        # finished sequences' caches, oldest first, kept while their rows are not needed: the last one only where
        # the group's rows share one store of positions (llama.cpp's window), as many as rows are free elsewhere
        self.kept: list[_Cached] = []
        self.prompt_cache_bytes = prompt_cache_bytes
        self.stored: list[_Stored] = []  # kept caches copied out of their rows, oldest first
        self.group = target.new_kv_group(max_batch)
        self.costs = shared_cost_curve(target)
        self.counters = BatchCounters()
        self._incoming: queue.SimpleQueue[BatchedSequence] = queue.SimpleQueue()
        self.waiting: deque[BatchedSequence] = deque()  # submitted, no cache yet
        self.prefilling: deque[BatchedSequence] = deque()  # cache taken, prompt being fed
        self.running: list[BatchedSequence] = []  # decoding
        self._cap: int | None = None  # the last shared draft cap (padded backends)

    # ------------------------------------------------------------ admission
    def submit(self, decoder: SpeculativeDecoder, request: Request, on_delta: Callable[[str], None] | None = None,
               on_done: Callable[[BatchedSequence], None] | None = None) -> BatchedSequence:
        """Queue a request (from ``decoder.request(...)``); it joins at the next step with room. Thread-safe."""
        self.check_decoder(decoder)
        seq = BatchedSequence(decoder, request, on_delta, on_done)
        self._incoming.put(seq)
        return seq

    def check_decoder(self, decoder: SpeculativeDecoder) -> None:
        """Refuse a decoder this batch cannot run: another target, or a drafter of token trees (a tree is verified
        with an attention mask of its own, one sequence per pass)."""
        if decoder.target is not self.target:
            raise InvalidRequest("the decoder runs another target than this batch")
        if decoder.drafter is not None and decoder.drafter.tree_depth:
            raise InvalidRequest(f"the {decoder.drafter_name} drafter's token trees verify one sequence per pass; run "
                                 "them unbatched (max batch 1 in the server) or drop the tree option")

    def cancel(self, seq: BatchedSequence) -> None:
        """Stop a sequence (its client left); it leaves the batch at the next step. Thread-safe."""
        seq.cancelled = True

    @property
    def busy(self) -> bool:
        return bool(self.running or self.prefilling or self.waiting or not self._incoming.empty())

    @property
    def size(self) -> int:
        """Sequences holding a cache (decoding or prefilling)."""
        return len(self.running) + len(self.prefilling)

    # ------------------------------------------------------------ the loop
    @torch.inference_mode()
    def step(self) -> None:
        """Admit, feed one prefill chunk, run one shared decode pass."""
        while not self._incoming.empty():
            self.waiting.append(self._incoming.get())
        self._drop_cancelled()
        with torch_threads(host_threads(self.target)):
            while self.waiting and self.size < self.max_batch:
                self._admit(self.waiting.popleft())
            self._prefill()
            if self.running:
                self._decode()

    def run(self) -> None:
        """Step until every submitted sequence has finished."""
        while self.busy:
            self.step()

    def _admit(self, seq: BatchedSequence) -> None:
        try:
            seq.state = seq.decoder.new_state(seq.request)  # its cache comes when its prefill starts
            seq.start = time.perf_counter()
        except Exception as exc:  # noqa: BLE001 - fail this request only
            self._fail(seq, exc)
            return
        self.prefilling.append(seq)

    def _take_cache(self, seq: BatchedSequence) -> None:
        """Give a sequence whose prefill starts its cache: a kept one or a new row, holding the longest prompt
        prefix any cached sequence shares with it (never the pending last token). Taken at the start of its
        prefill rather than at admission, so prompts admitted together share what the earlier ones prefilled."""
        state, decoder = seq.state, seq.decoder
        layers = decoder.feature_layers
        best, keep = None, 0
        if self.reuse_prefix and decoder.reuse_prefix:
            for donor in self._donors():
                if layers and donor.layers != layers:
                    continue  # its hidden states are not the ones this drafter reads
                n = reusable_prefix(donor.tokens, state.tokens, len(donor.features) if layers else None)
                if n > keep:
                    best, keep = donor, n
        in_use = sum(s.state.cache is not None for s in (*self.running, *self.prefilling))
        free = self.group.capacity - in_use - len(self.kept)  # rows neither live nor keeping a finished cache
        kept = best is not None and any(best is k for k in self.kept)
        if kept and (keep == len(best.tokens) or free < 1):
            # adopt it, nothing copied: all it holds is this prompt's prefix (a conversation's next turn), or no row
            # is free (then what the prefix leaves out is first copied out of the row, where the group can)
            if keep < len(best.tokens):
                self._copy_out(best)
            self.kept = [k for k in self.kept if k is not best]
            best.cache.truncate(keep)
            state.cache = best.cache
            if layers:
                best.features.truncate(keep)
                state.features = best.features
        else:
            while self.kept and in_use + len(self.kept) + 1 > self.group.capacity:
                self._store(self.kept.pop(0))  # the oldest kept cache's row is needed
            state.cache = self.group.new_kv()
            if isinstance(best, _Stored):
                self.group.restore(best.snapshot, state.cache, keep)
                self.stored = [x for x in self.stored if x is not best] + [best]  # the latest used: dropped last
            elif best is not None:  # a live or kept cache's prefix, the cache left whole for the next prompts
                self.group.copy_prefix(best.cache, state.cache, keep)
                if layers:
                    state.features.extend_from(best.features, keep)
        state.cached_tokens = state.tokens[:keep]
        state.stats.reused_prompt_tokens = keep
        self.counters.reused_prompt_tokens += keep

    def _donors(self):
        """Caches a joining prompt may copy from: every sequence holding a cache, and the kept ones (the latest
        first)."""
        for seq in (*self.running, *self.prefilling):
            cached = _Cached.of(seq)
            if cached is not None:
                yield cached
        yield from reversed(self.kept)
        yield from reversed(self.stored)

    def _store(self, cached: _Cached) -> None:
        """Give back a kept cache's row, its keys and values first copied out (``_copy_out``)."""
        self._copy_out(cached)
        cached.cache.close()

    def _copy_out(self, cached: _Cached) -> None:
        """Copy a kept cache's keys and values out of its row into memory (``prompt_cache_bytes``, the oldest copies
        dropped first) where the group can and its sequence's drafter reads no hidden states."""
        snapshot = getattr(self.group, "snapshot", None)
        if self.prompt_cache_bytes and snapshot is not None and not cached.layers and cached.tokens:
            copied, nbytes = snapshot(cached.cache, len(cached.tokens))
            if nbytes <= self.prompt_cache_bytes:
                self.stored.append(_Stored(list(cached.tokens), copied, nbytes))
                while sum(s.nbytes for s in self.stored) > self.prompt_cache_bytes:
                    self.stored.pop(0)

    @property
    def parked(self) -> _Cached | None:
        """The last finished sequence's kept cache, if it is kept."""
        return self.kept[-1] if self.kept else None

    @torch.inference_mode()  # a row given back may move another (the caches' tensors are inference tensors)
    def drop_parked(self) -> None:
        """Give back the rows of the finished sequences' caches (kept for prompt-prefix reuse)."""
        while self.kept:
            self.kept.pop().cache.close()

    def _prefill(self) -> None:
        """Feed joining prompts, in arrival order, ``prefill_chunk`` tokens in all this step while others decode, so
        short prompts join together instead of one a step; with no stream waiting, the first prompt whole. A prompt
        is cut where it would be cut alone (every ``prefill_chunk`` tokens, never at what is left of a step's
        budget): on a backend whose numbers depend on the pass's width (bfloat16 transformers) its prefill then
        gives the same bits whoever joined beside it."""
        budget = self.prefill_chunk
        while self.prefilling:
            seq = self.prefilling[0]
            fed = self._prefill_chunk(seq, budget)
            if fed is None or (self.prefilling and self.prefilling[0] is seq):
                break  # it waits for the next step's budget, or its prompt is not all in
            budget -= fed
            if budget <= 0:
                break

    def _prefill_chunk(self, seq: BatchedSequence, budget: int) -> int | None:
        """Feed ``seq``'s next chunk (all of its prompt when no stream waits): the tokens fed, or ``None`` when
        that chunk is larger than what is left of this step's ``budget``."""
        state, decoder = seq.state, seq.decoder
        chunk: list[int] = []
        try:
            t0 = time.perf_counter()
            if state.cache is None:
                self._take_cache(seq)
            todo = state.tokens[len(state.cached_tokens) : -1]  # the pending (last) token is fed by the first step
            chunk = todo if not self.running else todo[: self.prefill_chunk]
            if len(chunk) > budget and budget < self.prefill_chunk:
                return None
            if chunk:
                decoder.prefill_chunk(state, chunk)
                self.counters.prefill_passes += 1
                self.counters.prefill_tokens += len(chunk)
            state.stats.prefill_seconds += time.perf_counter() - t0
            if len(state.cached_tokens) == len(state.tokens) - 1:
                decoder.begin(state, seq.request.k, calibrate=False)
                self.prefilling.popleft()
                self.running.append(seq)
        except Exception as exc:  # noqa: BLE001
            self.prefilling.popleft()
            self._fail(seq, exc)
        return len(chunk)

    def _cap_drafts(self, rows: list[BatchedSequence], plans: list[StepPlan]) -> int | None:
        """When the backend pads every row to the widest (transformers), one row's draft widens the pass for all,
        so per-row choices lock each other in: once one row verifies k tokens, more look free to every other. So
        after drafting, the batch cuts the drafts of its cost-policy rows to one shared length, the one with the
        most expected tokens per second for the whole pass (each row's acceptance estimate for the draft it made,
        the measured cost of the padded pass), keeping the last cap unless another is ``CAP_MARGIN`` better.
        Cutting a draft by its length only (never by its tokens) keeps verification lossless. Returns the cap, or
        ``None`` when there is nothing to cut (unpadded backend, one row, no costs measured yet)."""
        capped = [i for i, r in enumerate(rows) if r.decoder.drafter is not None and r.decoder.controller.policy == COST]
        longest = max((len(plans[i].draft) for i in capped), default=0)
        if len(rows) < 2 or not longest or not self.costs or self.target.pass_width([1, 2]) <= 3:
            return None
        rates = {}
        for cap in range(longest + 1):
            tokens, widths = 0.0, []
            for i, (r, plan) in enumerate(zip(rows, plans)):
                n = min(cap, len(plan.draft)) if i in capped else len(plan.draft)
                tokens += r.decoder.controller.predicted_tokens(n, plan.draft.confidence) if n else 1.0
                widths.append(len(plan.uncached) + n)
            width = self.target.pass_width(widths)
            rates[cap] = tokens / self.costs.at(width)
        best = max(rates, key=rates.get)
        last = min(self._cap, longest) if self._cap is not None else 0
        if rates[best] < rates[last] * (1 + CAP_MARGIN):  # change only for a clear gain (from plain, at first)
            best = last
        self._cap = best
        for i in capped:
            if len(plans[i].draft) > best:
                plans[i].draft = plans[i].draft.truncated(best)
        return best

    def _decode(self) -> None:
        rows = list(self.running)
        plans: list[StepPlan] = []
        began = []
        committed = sum(r.committed for r in rows)
        for i, seq in enumerate(rows):
            began.append(time.perf_counter())
            ctrl = seq.decoder.controller
            if len(rows) > 1:
                others = [r.width for j, r in enumerate(rows) if j != i]
                ctrl.share_passes(lambda w, o=others: self.target.pass_width([*o, w]), committed - seq.committed)
            else:
                ctrl.share_passes(None)
            plans.append(seq.decoder.plan(seq.state, seq.request.k, alone=len(rows) == 1))
        self._cap_drafts(rows, plans)
        layers = sorted({layer for seq in rows for layer in seq.decoder.feature_layers})
        widths = [len(plan.tokens) for plan in plans]
        t0 = time.perf_counter()
        try:
            outs = self.target.forward_batch([(seq.state.cache, plan.tokens) for seq, plan in zip(rows, plans)],
                                             feature_layers=layers)
        except Exception as exc:  # noqa: BLE001 - the pass failed: every sequence in it fails, the engine goes on
            for seq in rows:
                self.running.remove(seq)
                self._fail(seq, exc)
            return
        seconds = time.perf_counter() - t0
        computed = self.target.pass_width(widths)
        self.costs = shared_cost_curve(self.target)  # the curve of the passes as they run now (a program came in)
        if not (any(plan.contended for plan in plans) or self.target.programs_loading):
            self.costs.observe(computed, seconds)  # not beside a program loading in the background
        c = self.counters
        c.passes += 1
        c.sequences += len(rows)
        c.tokens += sum(widths)
        c.computed += computed
        c.speculating += sum(1 for plan in plans if plan.draft.tokens)
        c.seconds += seconds
        for seq, plan, out, width, t_row in zip(rows, plans, outs, widths, began):
            try:
                if layers and seq.decoder.feature_layers:
                    pick = [layers.index(layer) for layer in seq.decoder.feature_layers]
                    out = TargetPass(out.logits, out.hidden[:, pick])
                new_tokens, drafted, accepted = seq.decoder.settle(seq.state, plan, out, shared_pass_seconds=seconds)
                delta = seq.decoder.advance(seq.state, new_tokens, drafted, accepted, time.perf_counter() - t_row)
                seq.width, seq.committed = width, float(len(new_tokens))
                if delta and seq.on_delta is not None:
                    seq.on_delta(delta)
                if seq.state.finish_reason:
                    self._finish(seq)
            except Exception as exc:  # noqa: BLE001 - this sequence fails, the others go on
                if seq in self.running:  # a failure inside _finish comes after it left the running list
                    self.running.remove(seq)
                self._fail(seq, exc)

    def abort(self, exc: BaseException) -> None:
        """Fail every sequence in the engine (after an unexpected error in a step)."""
        while not self._incoming.empty():
            self.waiting.append(self._incoming.get())
        for pool in (self.waiting, self.prefilling, self.running):
            while pool:
                seq = pool.pop()
                self._fail(seq, exc)
        self.drop_parked()

    # ------------------------------------------------------------ leaving
    def _finish(self, seq: BatchedSequence) -> None:
        tail = seq.state.text.finish()
        if tail and seq.on_delta is not None:
            seq.on_delta(tail)
        self.running.remove(seq)
        cached = _Cached.of(seq) if self.reuse_prefix and seq.decoder.reuse_prefix else None
        if cached is not None:  # keep it for the next prompts (a conversation's next turn, a repeated prompt)
            if not getattr(self.group, "rows_apart", False):
                self.drop_parked()  # the rows share one store: keep the last cache only
            self.kept.append(cached)
            seq.state.cache = None
        self._release(seq)
        seq.result = seq.decoder.result(seq.state, seq.request, seq.start)
        save_cost_curve(self.costs)  # the padded passes' costs too, for the next process (throttled)
        if seq.on_done is not None:
            seq.on_done(seq)

    def _fail(self, seq: BatchedSequence, exc: BaseException) -> None:
        self._release(seq)
        seq.error = exc
        if seq.on_done is not None:
            seq.on_done(seq)

    def _release(self, seq: BatchedSequence) -> None:
        seq.decoder.controller.share_passes(None)
        if seq.state is not None and seq.state.cache is not None:
            seq.state.cache.close()
            seq.state.cache = None

    def _drop_cancelled(self) -> None:
        for pool in (self.waiting, self.prefilling, self.running):
            for seq in [s for s in pool if s.cancelled]:
                pool.remove(seq)
                self._release(seq)
                if seq.on_done is not None:
                    seq.on_done(seq)


def generate_batch(decoders: list[SpeculativeDecoder], prompts: list, max_batch: int = DEFAULT_MAX_BATCH,
                   prefill_chunk: int = DEFAULT_PREFILL_CHUNK, **options) -> list[Generation]:
    """Generate for every prompt with continuous batching; ``decoders[i]`` runs ``prompts[i]`` (give each its
    own decoder: drafters keep per-sequence state). Options as ``SpeculativeDecoder.generate``."""
    if len(decoders) != len(prompts):
        raise InvalidRequest(f"{len(prompts)} prompts need as many decoders, got {len(decoders)}")
    if not decoders:
        return []
    if len({id(d) for d in decoders}) != len(decoders):
        raise InvalidRequest("give every prompt its own decoder (drafters keep per-sequence state)")
    engine = BatchEngine(decoders[0].target, max_batch=max_batch, prefill_chunk=prefill_chunk)
    seqs = [engine.submit(d, d.request(p, **options)) for d, p in zip(decoders, prompts)]
    engine.run()
    for seq in seqs:
        if seq.error is not None:
            raise seq.error
    return [seq.result for seq in seqs]


def sample_seeds(seed: int | None, n: int) -> list[int | None]:
    """The seeds of ``n`` samples of one request: ``seed + i`` (within 63 bits) when a seed is given, else each its
    own random seed (None: ``SpeculativeDecoder.request`` draws one)."""
    return [None if seed is None else (seed + i) % 2**63 for i in range(n)]


def join_siblings(decoders: list[SpeculativeDecoder], group: dict | None) -> None:
    """Make the decoders' drafters draft their next requests as samples of one request (each from the others'
    text, where the drafter can: ``Drafter.join_siblings``), or, with None, as requests of their own."""
    for decoder in decoders:
        if decoder.drafter is not None:
            decoder.drafter.join_siblings(group)


def generate_samples(decoders: list[SpeculativeDecoder], prompt, seed: int | None = None,
                     max_batch: int | None = None, **options) -> list[Generation]:
    """``len(decoders)`` samples of one prompt as rows of one batch (OpenAI's ``n``; ``max_batch`` rows at a time,
    default all): the prompt is prefilled once
    and copied to the other rows, sample i is seeded ``seed + i``, and each drafts from its siblings' text as they
    write it (the suffix drafter). Lossless jointly: every sample's tokens are distributed as the target's given
    its own prefix, whatever its siblings wrote (docs/serving.md). Options as ``SpeculativeDecoder.generate``."""
    if not decoders:
        raise InvalidRequest("generate_samples needs one decoder per sample, got none")
    if len({id(d) for d in decoders}) != len(decoders):
        raise InvalidRequest("give every sample its own decoder (drafters keep per-sequence state)")
    engine = BatchEngine(decoders[0].target, max_batch=max_batch or len(decoders))
    join_siblings(decoders, {})
    try:
        seqs = [engine.submit(d, d.request(prompt, seed=s, **options))
                for d, s in zip(decoders, sample_seeds(seed, len(decoders)))]
        engine.run()
    finally:
        join_siblings(decoders, None)
    for seq in seqs:
        if seq.error is not None:
            raise seq.error
    return [seq.result for seq in seqs]


class BatchWorker:
    """A thread that steps a ``BatchEngine`` while it has work (the server's generation loop). ``submit`` and
    ``cancel`` from any thread; callbacks run on the worker thread."""

    def __init__(self, engine: BatchEngine, name: str = "verispec-batch") -> None:
        self.engine = engine
        self._wake = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, decoder: SpeculativeDecoder, request: Request, on_delta=None, on_done=None) -> BatchedSequence:
        seq = self.engine.submit(decoder, request, on_delta, on_done)
        with self._wake:
            self._wake.notify()
        return seq

    def cancel(self, seq: BatchedSequence) -> None:
        self.engine.cancel(seq)

    @property
    def alive(self) -> bool:
        """The stepping thread is running (a replica's health check asks)."""
        return self._thread.is_alive()

    def stop(self, timeout: float | None = 5.0) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._stopped and not self.engine.busy:
                    self._wake.wait()
                if self._stopped:
                    return
            try:
                self.engine.step()
            except Exception as exc:  # noqa: BLE001 - a bug in a step fails its sequences, never the worker
                log.exception("batch step failed")
                self.engine.abort(exc)
