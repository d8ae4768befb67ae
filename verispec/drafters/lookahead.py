"""Lookahead decoding (Fu et al. 2024): Jacobi iteration guesses n-grams in the target's own passes; no draft model.

The drafter keeps a window of guesses, ``ngram - 1`` levels of ``window`` tokens. Each step it proposes one token
tree that holds two branches, fed in the step's single target pass:

- the *lookahead branch*: level 0's columns 1..W-1 as a chain after the pending token (level 0's column 0 is the
  pending token itself) and, hanging off column c of that chain, the column's tokens of levels 1..N-2. Column c's
  tokens then sit at consecutive positions and see exactly the prefix, level 0 up to column c and their own column
  (the attention mask of the lookahead paper and of llama.cpp's example, written as a tree, so any backend that
  verifies trees runs it). The target's greedy token at each column's last level is the column's next guess: one
  Jacobi iteration per step.
- the *verification branch*: the n-grams the window produced earlier (a pool, up to ``candidates`` per first token)
  that start with the pending token, merged into a trie. With ``context_pool`` (default) the pool also holds the
  context's own n-grams, as the lookahead authors' implementation offers (``POOL_FROM_PROMPT``): without them the
  pool starts empty, early steps accept almost nothing, and the controller stops paying for the wide pass before
  the window has produced anything.

Every node is a deterministic guess, so the engine verifies the whole tree as one-hot candidates
(``verify.verify_tree``): greedy output is plain decoding's, and sampled output follows the target exactly. Then
``observe_logits`` reads the target's greedy tokens at the lookahead branch's last level, adds each column's
n-gram (its level 0 token, the tokens above it, the new guess) to the pool and shifts the window up a level.

Draft budget: ``k`` nodes per step (the controller may give fewer). The verification branch takes at most half of
them; the lookahead branch takes what is left, as many whole columns as fit (a column not fed keeps its guesses).
The pass is wide (N-1 tokens per column plus the candidates), which the controller prices with the measured cost
of each pass width.
"""

from __future__ import annotations

import random
from typing import Sequence

import torch

from ..errors import check_whole
from ..sampling import SamplingParams, greedy_tokens
from .base import EMPTY_DRAFT, Draft, DrafterBase
from .registry import DrafterSpec, Option, register


class LookaheadDrafter(DrafterBase):
    name = "lookahead"
    flat_cost = True  # a lookup: a longer draft costs no more

    def __init__(self, window: int = 5, ngram: int = 3, candidates: int = 5, context_pool: bool = True) -> None:
        check_whole("lookahead window", window, 1, 64)
        check_whole("lookahead n-gram size", ngram, 3, 16)
        check_whole("lookahead candidates", candidates, 0, 64)
        self.window, self.ngram, self.candidates = window, ngram, candidates
        self.context_pool = bool(context_pool)
        self.tree_depth = max(window - 1 + ngram - 2, ngram - 1)
        self.reset()

    def reset(self, sampling: SamplingParams | None = None, generator: torch.Generator | None = None) -> None:
        self._levels: list[list[int]] | None = None  # [ngram - 1][window] guesses; level 0 column 0 = pending token
        self._pool: dict[int, list[tuple[int, ...]]] = {}  # first token -> (ngram - 1)-grams after it, newest last
        self._seen = 0  # context length at the last proposal
        self._last_token: int | None = None
        self._fed: list[int | None] = []  # per column: the node index of its last-level guess in the last proposal
        self._root: int | None = None  # the pending token of the last proposal
        self._indexed = 0  # context positions whose n-grams are in the pool (context_pool)

    # ----------------------------------------------------------------- window
    def _sync(self, context: Sequence[int]) -> None:
        """Start over for a context that does not extend the last one (a new request)."""
        if len(context) < self._seen or (self._seen and context[self._seen - 1] != self._last_token):
            self.reset()
        if self._levels is None:
            # initial guesses: tokens of the context, chosen by a generator seeded with its length (deterministic)
            pick = random.Random(len(context))
            self._levels = [[context[pick.randrange(len(context))] for _ in range(self.window)]
                            for _ in range(self.ngram - 1)]
        self._seen, self._last_token = len(context), context[-1]
        if self.context_pool:  # the context's own n-grams (prompt and answer so far) join the pool
            for i in range(self._indexed, len(context) - self.ngram + 1):
                self._add(context[i], tuple(context[i + 1 : i + self.ngram]))
            self._indexed = max(self._indexed, len(context) - self.ngram + 1)

    def _add(self, first: int, gram: tuple[int, ...]) -> None:
        """Pool an n-gram (newest last; one already there moves to the end; at most ``candidates`` per first)."""
        pooled = self._pool.setdefault(first, [])
        if gram in pooled:
            pooled.remove(gram)
        pooled.append(gram)
        if len(pooled) > self.candidates:
            del pooled[0]

    def propose(self, context: Sequence[int], k: int) -> Draft:
        if not context or k <= 0:
            return EMPTY_DRAFT
        self._sync(context)
        root = context[-1]
        tokens: list[int] = []
        parents: list[int] = []
        # verification branch: the pool's n-grams that start with the pending token, as a trie, at most half of k
        children: dict[tuple[int, int], int] = {}
        room = k // 2 if self.window else k
        for gram in reversed(self._pool.get(root, [])):
            parent = -1
            for token in gram:
                node = children.get((parent, token))
                if node is None:
                    if len(tokens) >= room:
                        break
                    node = children[(parent, token)] = len(tokens)
                    tokens.append(token)
                    parents.append(parent)
                parent = node
        # lookahead branch: whole columns while they fit (column c: level 0's token, then levels 1..N-2 above it)
        columns = min(self.window, (k - len(tokens) + 1) // (self.ngram - 1))
        self._fed = [None] * self.window
        self._root = root
        trunk = -1  # node of level 0's previous column (-1: the pending token, which is column 0)
        for c in range(columns):
            if c:
                tokens.append(self._levels[0][c])
                parents.append(trunk)
                trunk = len(tokens) - 1
            parent = trunk
            for level in range(1, self.ngram - 1):
                tokens.append(self._levels[level][c])
                parents.append(parent)
                parent = len(tokens) - 1
            self._fed[c] = parent
        return Draft(tokens, parents=parents) if tokens else EMPTY_DRAFT

    def observe_logits(self, logits: torch.Tensor) -> None:
        """The target's logits of the last pass: row 0 after the pending token, row 1 + i after draft node i. Reads
        the greedy token after each fed column's last guess, pools the columns' n-grams and shifts the window."""
        if self._levels is None or not any(node is not None for node in self._fed):
            return
        rows = [1 + node for node in self._fed if node is not None]
        best = greedy_tokens(logits[rows])
        new = list(self._levels[0])  # an unfed column keeps its guesses: its next level repeats its first
        for c, node in enumerate(self._fed):
            if node is None:
                continue
            new[c] = best.pop(0)
            first = self._root if c == 0 else self._levels[0][c]
            self._add(first, tuple(self._levels[level][c] for level in range(1, self.ngram - 1)) + (new[c],))
        self._levels = self._levels[1:] + [new]
        self._fed = []


register(DrafterSpec(
    "lookahead", "lookahead decoding: Jacobi iterations in the target's own passes guess n-grams (no draft model)",
    lambda target, draft_model, **options: LookaheadDrafter(**options),
    options=(Option("window", int, 5, "Jacobi window W of --drafter lookahead: columns guessed in parallel"),
             Option("ngram", int, 3, "n-gram size N of --drafter lookahead (levels of guesses + 1; at least 3)"),
             Option("candidates", int, 5, "pooled n-grams per first token that --drafter lookahead verifies (G)"),
             Option("context_pool", bool, True, "--drafter lookahead also pools the context's own n-grams (prompt "
                    "and answer so far; as the lookahead authors' POOL_FROM_PROMPT)", flag="lookahead-context-pool")),
    trees=lambda options: True, tree_option="",
    runs_on=lambda target: target.supports_trees,
    requirement="a target that verifies token trees (transformers or openvino)",
))
