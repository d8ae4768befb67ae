"""The acceptance rule, as pure functions on tensors (no model, no cache).

Notation follows Leviathan et al. (2023) and Chen et al. (2023):

    x_1..x_k   draft tokens proposed by the drafter
    q_i        the drafter's distribution for x_i             [k, vocab]
    p_i        the target's distribution at position i        [k+1, vocab]
               (p_{k+1} is the distribution after all k drafts, used for the bonus token)

Strict rule: accept x_i with probability min(1, p_i(x_i) / q_i(x_i)). At the first rejection, sample the
*correction* token from norm(max(p_i - q_i, 0)). If all k are accepted, sample the *bonus* token from
p_{k+1}. Every verify step therefore commits num_accepted + 1 tokens, and the committed sequence is
distributed exactly as if the target had sampled every token itself.

Drafts without probabilities (n-gram lookup) are the one-hot case q_i = onehot(x_i): accept with
probability p_i(x_i); the residual is p_i with x_i removed, renormalised. Greedy decoding is the case
p_i = onehot(argmax) (see ``sampling.probabilities``): accept while x_i is the argmax, then the argmax.

The engine runs the one-hot case as ``verify_positional`` (and trees of candidates as ``verify_tree_positional``):
the same acceptance and residual, with the randomness of each sequence position fixed by (seed, position), so that
the committed tokens are those plain sampling with the same seed draws. ``verify`` with a generator remains the
rule for drafts with a distribution q (draft models, sampled heads).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import position_uniform, sample, sample_at

STRICT = "strict"
TYPICAL = "typical"
ACCEPTANCE_MODES = (STRICT, TYPICAL)
LOSSY_MODES = frozenset({TYPICAL})


@dataclass(frozen=True)
class Verdict:
    """Outcome of one verify step: how many draft tokens were accepted and the token that follows them
    (the correction token after a rejection, or the bonus token when all were accepted)."""

    num_accepted: int
    next_token: int


def _first_rejection(accepted: torch.Tensor) -> int:
    # number of leading True values in a 1-D bool tensor
    return int(accepted.to(torch.int32).cumprod(dim=0).sum())


def verify(
    draft_tokens: torch.Tensor,
    q: torch.Tensor | None,
    p: torch.Tensor,
    generator: torch.Generator | None,
) -> Verdict:
    """Strict rejection sampling. ``draft_tokens`` [k] long, ``q`` [k, V] or None (one-hot drafts),
    ``p`` [k+1, V]. Lossless for any q."""
    k = draft_tokens.numel()
    if p.shape[0] != k + 1:
        raise ValueError(f"p must have k+1={k + 1} rows, got {p.shape[0]}")
    if k == 0:
        return Verdict(0, sample(p[0], generator))
    positions = torch.arange(k, device=p.device)
    p_x = p[positions, draft_tokens]  # [k]
    q_x = torch.ones_like(p_x) if q is None else q[positions, draft_tokens]  # [k]
    u = torch.rand(k, generator=generator, dtype=p_x.dtype, device=p.device)
    # u < p/q, written without the division so that q_x = 0 (a token the drafter could not have drawn) rejects
    n = _first_rejection(u * q_x < p_x)
    if n == k:
        return Verdict(k, sample(p[k], generator))
    if q is None:
        residual = p[n].clone()
        residual[draft_tokens[n]] = 0.0
    else:
        residual = (p[n] - q[n]).clamp_min_(0.0)
    total = residual.sum()
    if total <= 0:
        # A rejection has probability zero when p_n == q_n; guard against rounding making one happen anyway.
        residual, total = p[n], p[n].sum()
    return Verdict(n, sample(residual / total, generator))


def verify_positional(draft_tokens: list[int], p: torch.Tensor, seed: int, position: int) -> Verdict:
    """The strict rule for one-hot drafts (q_i = onehot(x_i)) with each position's randomness fixed in advance.

    The target's token t_i at each position is drawn from p_i by ``sample_at`` with the uniform of
    (``seed``, ``position`` + i) (``sampling.position_uniform``); x_i is accepted iff x_i = t_i, and the first t_i
    that differs is the correction (or, with every draft accepted, t_k the bonus). P(accept x_i) = p_i(x_i) and
    P(t_i = y | t_i != x_i) = p_i(y) / (1 - p_i(x_i)): the strict rule's acceptance and residual for one-hot q, so
    the output is the target's. And since t_i is what plain sampling with the same seed draws at that position, the
    committed tokens are the same whatever was drafted, however long the draft, whatever shares the batch: seeded
    output equals plain seeded output token for token. ``p`` [k+1, V]; rows after the first mismatch are not read."""
    k = len(draft_tokens)
    if p.shape[0] != k + 1:
        raise ValueError(f"p must have k+1={k + 1} rows, got {p.shape[0]}")
    for i in range(k + 1):
        t = sample_at(p[i], position_uniform(seed, position + i))
        if i == k or t != draft_tokens[i]:
            return Verdict(i, t)
    raise AssertionError("unreachable")


def verify_tree_positional(draft_tokens: list[int], parents: list[int], p: torch.Tensor, seed: int,
                           position: int) -> tuple[list[int], int]:
    """A tree of deterministic candidates, verified as ``verify_positional`` verifies a chain: at depth d the target's
    token is drawn from the current node's row of p with the uniform of (``seed``, ``position`` + d); the walk
    descends into the child carrying it and stops at the first drawn token no child carries. P(descend into child c)
    = p(c), the one-hot tree rule's (``verify_tree``), and the committed tokens equal plain seeded sampling's."""
    children = _children_by_token(draft_tokens, parents)
    if p.shape[0] != len(draft_tokens) + 1:
        raise ValueError(f"p must have {len(draft_tokens) + 1} rows (the pending token and each node), got {p.shape[0]}")
    path: list[int] = []
    node = -1
    while True:
        token = sample_at(p[node + 1], position_uniform(seed, position + len(path)))
        child = children.get(node, {}).get(token)
        if child is None:
            return path, token
        path.append(child)
        node = child


def verify_typical(
    draft_tokens: torch.Tensor,
    p: torch.Tensor,
    generator: torch.Generator | None,
    epsilon: float = 0.09,
    delta: float = 0.3,
) -> Verdict:
    """LOSSY Medusa-style typical acceptance: accept x_i while p_i(x_i) > min(epsilon, delta * exp(-H(p_i))).

    It ignores q, so the output no longer follows the target distribution. Off by default; every result
    produced with it is marked lossy. At temperature 0 (one-hot p) it coincides with greedy verification.
    """
    k = draft_tokens.numel()
    if k == 0:
        return Verdict(0, sample(p[0], generator))
    head = p[:k]  # [k, V]
    p_x = head[torch.arange(k, device=p.device), draft_tokens]
    entropy = -(head * torch.log(head.clamp_min(1e-30))).sum(dim=-1)
    threshold = torch.minimum(torch.full_like(entropy, epsilon), delta * torch.exp(-entropy))
    n = _first_rejection(p_x > threshold)
    return Verdict(n, sample(p[n], generator))


def _children_by_token(draft_tokens: list[int], parents: list[int]) -> dict[int, dict[int, int]]:
    """node -> {token: its first child carrying that token} (-1 = the pending token); parents must come first."""
    children: dict[int, dict[int, int]] = {}
    for i, (token, parent) in enumerate(zip(draft_tokens, parents)):
        if not -1 <= parent < i:
            raise ValueError(f"node {i} has parent {parent}; parents must come before their children")
        children.setdefault(parent, {}).setdefault(token, i)
    return children


def verify_tree_greedy(draft_tokens: list[int], parents: list[int], target_tokens: list[int]) -> tuple[list[int], int]:
    """Greedy verification of a *tree* of drafts. Node i is token ``draft_tokens[i]`` whose parent is node
    ``parents[i]`` (-1 = the pending token); parents come before their children. ``target_tokens[0]`` is the
    target's greedy token after the pending token and ``target_tokens[i + 1]`` its greedy token after node i
    (each computed with the node's ancestors as context).

    Walks from the root: while a child of the current node carries the target's greedy token, accept it and
    descend. Returns (the accepted nodes along the path, the target's greedy token after the last one), so the
    committed tokens are exactly those plain greedy decoding produces. ``verify_tree`` is the rule for sampling
    (at temperature 0 it gives the same path)."""
    children = _children_by_token(draft_tokens, parents)
    path: list[int] = []
    node = -1
    while True:
        token = target_tokens[node + 1]
        child = children.get(node, {}).get(token)
        if child is None:
            return path, token
        path.append(child)
        node = child


class TorchCoins:
    """The randomness of ``verify_tree``: a biased coin and a categorical draw from one seeded generator. Tests
    substitute a source that enumerates every outcome with its probability."""

    def __init__(self, generator: torch.Generator | None) -> None:
        self.generator = generator

    def bernoulli(self, probability: float) -> bool:
        if probability >= 1.0:
            return True
        if probability <= 0.0:
            return False
        return float(torch.rand((), generator=self.generator, dtype=torch.float64)) < probability

    def categorical(self, probs: torch.Tensor) -> int:
        return sample(probs, self.generator)


def verify_tree(draft_tokens: list[int], parents: list[int], p: torch.Tensor, coins,
                q: dict[int, torch.Tensor] | None = None) -> tuple[list[int], int]:
    """Lossless verification of a *tree* of drafts when sampling (multi-candidate speculative sampling: SpecInfer,
    Miao et al. 2024; EAGLE-2's sampling mode).

    Node i is token ``draft_tokens[i]`` under node ``parents[i]`` (-1 = the pending token; parents first).
    ``p`` [1 + N, V]: row 0 is the target's distribution after the pending token, row i + 1 after node i (each
    with the node's ancestors as context). Starting at the pending token, with residual r = p of the current node,
    the children are tried in the order they appear:

    - deterministic children (``q`` None or without an entry for the parent: n-gram branches, a head's top-k):
      accept x_j with probability r(x_j) / sum(r); on rejection remove x_j from r;
    - children drawn independently *with replacement* from the drafter's distribution ``q[parent]``: accept x_j
      with probability min(1, r(x_j) / q(x_j)); on rejection r <- max(r - q, 0).

    An accepted child becomes the current node (its own row of p starts a fresh residual); when every child is
    rejected (or a node has none) the next token is drawn from norm(r). Either way each committed token is
    distributed exactly as the target's own sample, whatever the candidates were. Returns (accepted nodes along
    the path, the token after them)."""
    children: dict[int, list[int]] = {}
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise ValueError(f"node {i} has parent {parent}; parents must come before their children")
        children.setdefault(parent, []).append(i)
    if p.shape[0] != len(draft_tokens) + 1:
        raise ValueError(f"p must have {len(draft_tokens) + 1} rows (the pending token and each node), got {p.shape[0]}")
    path: list[int] = []
    node = -1
    while True:
        residual = p[node + 1].double().clone()
        q_node = None if q is None else q.get(node)
        accepted = None
        for child in children.get(node, []):
            x = draft_tokens[child]
            total = float(residual.sum())
            if total <= 0.0:
                break
            if q_node is None:
                if coins.bernoulli(float(residual[x]) / total):
                    accepted = child
                    break
                residual[x] = 0.0
            else:
                qx = float(q_node[x])
                ratio = float(residual[x]) / (total * qx) if qx > 0 else 0.0
                if coins.bernoulli(ratio):
                    accepted = child
                    break
                residual = (residual / total - q_node.double()).clamp_min(0.0)
        if accepted is None:
            total = float(residual.sum())
            if total <= 0.0:  # only rounding can empty the residual; the target's own row is then exact
                residual, total = p[node + 1].double(), float(p[node + 1].sum())
            return path, coins.categorical(residual / total)
        path.append(accepted)
        node = accepted
