"""Suffix drafts: propose the most frequent continuations of the context's longest suffix match in everything already
written, the current request's prompt and answer and (scope ``process``) earlier requests' too.

The idea is SuffixDecoding's (Oliaro et al., 2024; vLLM's ``suffix`` method): no model, drafts from a store of earlier
text, candidates scored by how often they followed the match, the draft as long as the evidence for it. The store here
is an index of every ``n``-gram's occurrences (the most recent ``per_key`` of each) and every token's (the most recent
``per_token``) over bounded sequences; a lookup takes the occurrences of the context's last ``n`` tokens (or, where those never occurred and
``min_n`` is 1, of its last token alone), measures how far back each one matches the context (up to ``max_match``
tokens), keeps those of the longest match and counts their continuations in a trie. A
chain follows the most frequent child while its share of the matches stays at or above ``min_share``; a tree takes
the ``k`` nodes of highest share (best first). Drafts are deterministic, so acceptance treats q as one-hot: lossless
at any temperature whatever the store holds.

The store is bounded by ``max_tokens`` (oldest finished sequences go first) and shared by every suffix drafter of
the process with scope ``process`` (a lock guards it: server rows and threads share one). Other requests' text cannot
change any output, but how fast an answer comes can hint whether earlier requests held similar text; scope
``request`` keeps each request to its own text (docs/serving.md).
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from typing import Sequence

import torch

from ..errors import InvalidRequest, check_whole
from ..sampling import SamplingParams
from .base import EMPTY_DRAFT, Draft, DrafterBase
from .registry import DrafterSpec, Option, register

SCOPES = ("process", "request")


class SuffixStore:
    """Token sequences and where each ``n``-gram and each single token occurs in them, bounded by ``max_tokens``;
    thread-safe."""

    def __init__(self, n: int = 2, max_tokens: int = 200_000, per_key: int = 64, per_token: int = 16) -> None:
        check_whole("suffix store n", n, 1, 64)
        self.n, self.max_tokens, self.per_key = n, max_tokens, per_key
        # a single token's matches: fewer kept (they are the fallback; the most recent carry the drafts)
        self.per_token = per_token if n > 1 else per_key
        self.sizes = (n,) if n == 1 else (n, 1)
        self.sequences: OrderedDict[int, list[int]] = OrderedDict()  # oldest first
        self.active: set[int] = set()  # sequences a drafter is still writing (never evicted)
        # n-gram or 1-gram -> (sequence, continuation start); the two lengths share one dict (tuples never collide)
        self.index: dict[tuple[int, ...], list[tuple[int, int]]] = {}
        self.tokens = 0  # held in live sequences
        self.stale = 0  # index entries that may point at evicted sequences
        self.lock = threading.RLock()
        self._ids = itertools.count()

    def open(self) -> int:
        with self.lock:
            sid = next(self._ids)
            self.sequences[sid] = []
            self.active.add(sid)
            return sid

    def close(self, sid: int) -> None:
        with self.lock:
            self.active.discard(sid)
            self._evict()

    def extend(self, sid: int, tokens: Sequence[int]) -> None:
        """Append ``tokens`` to sequence ``sid`` and index the n-grams that now have a continuation."""
        with self.lock:
            seq = self.sequences.get(sid)
            if seq is None:  # evicted while idle: start it again
                seq = self.sequences[sid] = []
            start = len(seq)
            seq.extend(tokens)
            self.tokens += len(tokens)
            # the grams ending at position e are indexed once position e + 1 exists
            for end in range(max(start - 1, 0), len(seq) - 1):
                self._add(sid, seq, end)
            self._evict()

    def _add(self, sid: int, seq: list[int], end: int) -> None:
        for size in self.sizes:
            if end + 1 >= size:
                seen = self.index.setdefault(tuple(seq[end + 1 - size : end + 1]), [])
                seen.append((sid, end + 1))
                if len(seen) > (self.per_key if size == self.n else self.per_token):
                    del seen[0]

    def _evict(self) -> None:
        while self.tokens > self.max_tokens:
            victim = next((sid for sid in self.sequences if sid not in self.active), None)
            if victim is None:
                return  # only sequences still being written: they stay
            dropped = self.sequences.pop(victim)
            self.tokens -= len(dropped)
            self.stale += len(dropped)
        if self.stale > max(self.tokens, 4096):  # entries of evicted sequences outnumber live ones: rebuild
            self._rebuild()

    def _rebuild(self) -> None:
        self.index, self.stale = {}, 0
        for sid, seq in self.sequences.items():
            for end in range(len(seq) - 1):
                self._add(sid, seq, end)

    def matches(self, context: Sequence[int], max_match: int, depth: int, exclude_end: tuple[int, int] | None = None,
                min_n: int | None = None) -> tuple[int, list[list[int]]]:
        """(m, continuations): the longest match length m >= n of the context's suffix and the continuations (up to
        ``depth`` tokens each) of every occurrence matching that far, most recent first; where no occurrence matches n
        tokens and ``min_n`` (default n) is 1, the same for the last token alone (m = 1); (0, []) for none.
        ``exclude_end`` = (sequence, length): the context itself, whose own end is no match."""
        shortest = self.n if min_n is None else min_n
        for size in self.sizes:
            if size >= shortest:
                found = self._matches(context, size, max_match, depth, exclude_end)
                if found[0]:
                    return found
        return 0, []

    def _matches(self, context: Sequence[int], n: int, max_match: int, depth: int,
                 exclude_end: tuple[int, int] | None) -> tuple[int, list[list[int]]]:
        if len(context) < n:
            return 0, []
        with self.lock:
            found = self.index.get(tuple(context[len(context) - n :]))
            if not found:
                return 0, []
            best, conts = 0, []
            for sid, start in reversed(found):
                seq = self.sequences.get(sid)
                if seq is None or (sid, start) == exclude_end or start >= len(seq):
                    continue
                m = n
                limit = min(max_match, start, len(context))
                while m < limit and seq[start - 1 - m] == context[len(context) - 1 - m]:
                    m += 1
                if m > best:
                    best, conts = m, []
                if m == best:
                    conts.append(seq[start : start + depth])
            return best, conts


_SHARED: SuffixStore | None = None
_SHARED_LOCK = threading.Lock()


def shared_store() -> SuffixStore:
    """The process's store (scope ``process``)."""
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None:
            _SHARED = SuffixStore()
        return _SHARED


class SuffixDrafter(DrafterBase):
    name = "suffix"
    flat_cost = True  # a lookup: a longer draft costs no more

    def __init__(self, tree: bool = False, max_match: int = 32, min_share: float = 0.2, scope: str = "process",
                 store: SuffixStore | None = None, min_n: int | None = None) -> None:
        check_whole("suffix max_match", max_match, 2, 1024)
        if min_n is None:  # chains draft from a one-token match (measured: docs/suffix.md); trees as before, unmeasured
            min_n = 2 if tree else 1
        if min_n not in (1, 2):
            raise InvalidRequest(f"suffix min_n must be 1 (a match of the last token alone drafts) or 2, got {min_n!r}")
        if not 0.0 <= min_share <= 1.0:
            raise InvalidRequest(f"suffix min_share must be within [0, 1], got {min_share!r}")
        if scope not in SCOPES:
            raise InvalidRequest(f"suffix scope must be one of {', '.join(SCOPES)}, got {scope!r}")
        self.tree, self.max_match, self.min_share, self.scope = bool(tree), max_match, min_share, scope
        self.min_n = min_n
        self.store = store or (shared_store() if scope == "process" else SuffixStore())
        self.tree_depth = 64 if self.tree else None
        self._group: dict | None = None  # the samples of one request: they draft from one store
        self._sid: int | None = None
        self._length = 0  # tokens of the current sequence already in the store
        self._last = -1

    def isolate(self) -> None:
        """Draft from a store of this drafter's own (its earlier sequences), not the process's: bench methods side by
        side must not draft from each other's answers to the same question."""
        self._finish()
        self.store = self._new_store()

    def join_siblings(self, group: dict | None) -> None:
        """Samples of one request draft from each other's text as it is written: they share one store (scope
        ``request``: a new one for the group; scope ``process``: the first sibling's, normally the process's)."""
        self._group = group

    def reset(self, sampling: SamplingParams | None = None, generator: torch.Generator | None = None) -> None:
        self._finish()
        group = self._group
        if group is not None:
            fresh = self.scope == "request" and "suffix-store" not in group
            self.store = group.setdefault("suffix-store", self._new_store() if fresh else self.store)
        elif self.scope == "request":
            self.store = self._new_store()

    def _new_store(self) -> SuffixStore:
        return SuffixStore(self.store.n, self.store.max_tokens, self.store.per_key, self.store.per_token)

    def _finish(self) -> None:
        if self._sid is not None:
            self.store.close(self._sid)
        self._sid, self._length, self._last = None, 0, -1

    def __del__(self) -> None:
        try:
            self._finish()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def _sync(self, context: Sequence[int]) -> None:
        if self._sid is None or len(context) < self._length or (self._length and context[self._length - 1] != self._last):
            self._finish()  # not an extension of what is stored: a new sequence (the old one stays as history)
            self._sid = self.store.open()
        if len(context) > self._length:
            self.store.extend(self._sid, context[self._length :])
            self._length, self._last = len(context), int(context[-1])

    def propose(self, context: Sequence[int], k: int) -> Draft:
        self._sync(context)
        m, conts = self.store.matches(context, self.max_match, k, exclude_end=(self._sid, len(context)),
                                      min_n=self.min_n)
        conts = [c for c in conts if c]
        if not conts:
            return EMPTY_DRAFT
        trie = _Trie(conts)
        if self.tree:
            return trie.best_tree(k)
        tokens, shares = trie.best_chain(k, self.min_share)
        if not tokens:
            return EMPTY_DRAFT
        # a longer match and a larger share of the matches agreeing are likelier to be accepted
        return Draft(tokens, confidence=[s * m / (m + 1) for s in shares])


class _Trie:
    """Counts of the continuations' prefixes: node -> {token: child}, with how many continuations pass each node."""

    def __init__(self, conts: list[list[int]]) -> None:
        self.children: list[dict[int, int]] = [{}]
        self.count: list[int] = [len(conts)]
        self.token: list[int] = [-1]
        for cont in conts:  # most recent first: among equal counts the most recent continuation's node came first
            node = 0
            for token in cont:
                child = self.children[node].get(token)
                if child is None:
                    child = len(self.count)
                    self.children[node][token] = child
                    self.children.append({})
                    self.count.append(0)
                    self.token.append(token)
                self.count[child] += 1
                node = child

    def best_chain(self, k: int, min_share: float) -> tuple[list[int], list[float]]:
        tokens, shares, node, total = [], [], 0, self.count[0]
        while len(tokens) < k and self.children[node]:
            child = max(self.children[node].values(), key=lambda c: self.count[c])  # first of equals: most recent
            share = self.count[child] / total
            if share < min_share:
                break
            tokens.append(self.token[child])
            shares.append(share)
            node = child
        return tokens, shares

    def best_tree(self, k: int) -> Draft:
        """The k nodes with the largest share of the matches (a node's share never exceeds its parent's, so the
        best k form a tree), parents first."""
        import heapq

        order, frontier, tick = [], [], itertools.count()
        for child in self.children[0].values():
            heapq.heappush(frontier, (-self.count[child], next(tick), child, -1))
        tokens: list[int] = []
        parents: list[int] = []
        while frontier and len(tokens) < k:
            _, _, node, parent = heapq.heappop(frontier)
            tokens.append(self.token[node])
            parents.append(parent)
            order.append(node)
            for child in self.children[node].values():
                heapq.heappush(frontier, (-self.count[child], next(tick), child, len(tokens) - 1))
        return Draft(tokens, None, parents) if tokens else EMPTY_DRAFT


register(DrafterSpec(
    "suffix", "suffix drafts: the most frequent continuations of the longest match in this request's text and "
    "(scope process) earlier requests' (SuffixDecoding-style; no model)",
    lambda target, draft_model, **options: SuffixDrafter(**options),
    options=(Option("tree", bool, False, "with --drafter suffix, propose a tree of the most frequent continuations "
                    "(needs a backend with trees: transformers or openvino) instead of a chain"),
             Option("max_match", int, 32, "longest suffix match the suffix drafter measures (default: 32)"),
             Option("min_n", int, None, "shortest suffix match that drafts: 1 (the last token alone, where no two "
                    "tokens match) or 2 (default: 1 for chains, 2 for trees)", choices=(1, 2)),
             Option("min_share", float, 0.2, "a suffix chain stops where fewer than this share of the matches "
                    "agree (default: 0.2)"),
             Option("scope", str, "process", "what the suffix drafter drafts from: process (earlier requests' text "
                    "too; default) or request (this request's prompt and answer only)", choices=SCOPES)),
    trees=lambda options: bool(options.get("tree", False)), tree_option="tree",
))
