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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import sample

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


def verify_tree_greedy(draft_tokens: list[int], parents: list[int], target_tokens: list[int]) -> tuple[list[int], int]:
    """Greedy verification of a *tree* of drafts. Node i is token ``draft_tokens[i]`` whose parent is node
    ``parents[i]`` (-1 = the pending token); parents come before their children. ``target_tokens[0]`` is the
    target's greedy token after the pending token and ``target_tokens[i + 1]`` its greedy token after node i
    (each computed with the node's ancestors as context).

    Walks from the root: while a child of the current node carries the target's greedy token, accept it and
    descend. Returns (the accepted nodes along the path, the target's greedy token after the last one), so the
    committed tokens are exactly those plain greedy decoding produces. Sampling needs a different rule
    (recursive rejection over siblings), so trees are used for greedy decoding only."""
    children: dict[int, dict[int, int]] = {}
    for i, (token, parent) in enumerate(zip(draft_tokens, parents)):
        if not -1 <= parent < i:
            raise ValueError(f"node {i} has parent {parent}; parents must come before their children")
        children.setdefault(parent, {}).setdefault(token, i)
    path: list[int] = []
    node = -1
    while True:
        token = target_tokens[node + 1]
        child = children.get(node, {}).get(token)
        if child is None:
            return path, token
        path.append(child)
        node = child
