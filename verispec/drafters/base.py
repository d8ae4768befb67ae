"""The drafter protocol: every drafter plugs into the same engine loop through these three methods."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

import torch

from ..sampling import SamplingParams
from ..tree import depths


@dataclass
class Draft:
    """Proposed continuation. ``probs`` is q, the drafter's distribution for each token ([k, vocab]),
    or None when the drafter is deterministic (then q is one-hot on each proposed token).

    ``parents`` makes the draft a tree of deterministic candidates (q is one-hot on each node; any temperature,
    verified by ``verify.verify_tree``): node i is ``tokens[i]`` and follows node
    ``parents[i]`` (-1 = the pending token); parents come before children. None = a chain.

    ``confidence`` (optional, chains): the drafter's own guess in [0, 1] that each position is accepted; the
    engine's controller calibrates it against what the target accepts and uses it to decide how much of the
    draft to verify. For sampled tokens it must depend on the distribution the token was drawn from (e.g. its
    largest probability), never on the drawn token itself: verifying sampled tokens selected by their own value
    would bias them (see ``verispec.controller``).

    ``catch_up`` (optional): committed tokens the drafter had to read before it could draft, beyond the newest one
    (a draft model after plain steps reads every token committed since it last ran), and ``catch_up_seconds`` the
    time that reading took. The controller keeps that time apart from what each draft token costs, and counts it
    when it weighs going back to drafting after plain steps."""

    tokens: list[int]
    probs: torch.Tensor | None = None
    parents: list[int] | None = None
    confidence: list[float] | None = None
    catch_up: int = 0
    catch_up_seconds: float = 0.0

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def depth(self) -> int:
        """Draft positions proposed: the chain length, or the depth of the deepest tree node."""
        if self.parents is None:
            return len(self.tokens)
        return max(depths(self.parents), default=0)

    def truncated(self, n: int) -> "Draft":
        """The first n nodes (a prefix of a tree is a tree, since parents come first)."""
        return Draft(self.tokens[:n], None if self.probs is None else self.probs[:n],
                     None if self.parents is None else self.parents[:n],
                     None if self.confidence is None else self.confidence[:n], self.catch_up, self.catch_up_seconds)


EMPTY_DRAFT = Draft([])


@runtime_checkable
class Drafter(Protocol):
    """What the engine needs from a drafter: three methods and three declared capabilities.

    ``feature_layers``: the target's hidden-state layers it reads (indices into transformers' ``hidden_states``,
    0 = embeddings), () for none. The engine then calls ``propose(context, k, features=F)`` with F [n, L, H]: the
    target's hidden states at the last n committed positions before the pending one (n = len(context) - 1, every
    position, unless the prompt was prefilled without some), taken from the prefill and verify passes the engine runs
    anyway (no extra target forward). ``prompt_feature_rows``: how many of a prompt's last rows it reads, None for
    all; on llama.cpp, where a row's hidden state costs the row's logits too, the rest of the prompt is prefilled
    without them.

    ``tree_depth``: the depth of the trees it drafts for the current request, None when it drafts chains; read before
    drafting, so the controller can budget nodes instead of chain positions.

    ``flat_cost``: whether a proposal costs about the same whatever its length (a lookup), so the controller counts
    its drafting time per proposal rather than per token.

    ``stops_early``: whether ``propose`` takes ``enough``, a function of the confidences of the tokens drafted so far
    that says when drafting another token would not pay (the controller's ``draft_more``, negated); the engine then
    asks for the whole budget and the drafter stops where it says (a draft model, which pays per token drafted).

    Every drafter derives from ``DrafterBase``, which gives the defaults (no hidden states, chains, nothing to reset
    or observe) and the optional hooks (``observe_logits``, ``join_siblings``), so the engine calls them as they are."""

    name: str
    feature_layers: tuple[int, ...]
    tree_depth: int | None
    flat_cost: bool
    stops_early: bool

    def reset(self, sampling: SamplingParams, generator: torch.Generator | None) -> None:
        """Start a new sequence; drafters that sample use these parameters and this generator."""

    def propose(self, context: Sequence[int], k: int) -> Draft:
        """Up to ``k`` tokens that may follow ``context`` (all committed tokens, prompt included)."""

    def observe(self, num_accepted: int) -> None:
        """How many tokens of the last proposal the target accepted."""


class DrafterBase:
    """Defaults of the ``Drafter`` protocol: reads no hidden states, drafts chains, keeps no state to reset, learns
    nothing from verdicts."""

    name = "drafter"
    feature_layers: tuple[int, ...] = ()
    tree_depth: int | None = None
    prompt_feature_rows: int | None = None  # a prompt's last rows whose hidden states it reads (None: all)
    flat_cost: bool = False  # a proposal costs the same whatever its length (see ``Drafter``; lookups set it)
    stops_early: bool = False  # propose() takes ``enough`` and stops drafting where it says (see ``Drafter``)

    def reset(self, sampling: SamplingParams | None = None, generator: torch.Generator | None = None) -> None:
        pass

    def observe(self, num_accepted: int) -> None:
        pass

    def observe_logits(self, logits: torch.Tensor) -> None:
        """The target's logits of the last verify pass, after ``observe``: row 0 after the pending token, row 1 + i
        after draft node i (the lookahead drafter reads its Jacobi iteration from them); by default unused."""

    def join_siblings(self, group: dict | None) -> None:
        """Draft the next requests as one of several samples of one request (``n`` > 1), sharing what this drafter
        keeps with the others through ``group`` (one dict all the samples' drafters are given); None leaves the
        group. Optional (the engine checks for it); by default a drafter shares nothing."""
