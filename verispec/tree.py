"""Token trees: the target verifies many candidate continuations in one forward pass.

A tree of N draft nodes is given by ``parents`` (node i's parent, -1 = the pending token; parents before
children). Node i sits at position pending + depth(i) and attends to the committed context and to its own
ancestors only, through a custom 4-D attention mask (transformers uses a 4-D mask as given).
"""

from __future__ import annotations

import torch


def depths(parents: list[int]) -> list[int]:
    """Depth of each node (children of the pending token have depth 1)."""
    out: list[int] = []
    for parent in parents:
        out.append(1 if parent < 0 else out[parent] + 1)
    return out


def tree_inputs(past: int, fed: int, parents: list[int], dtype: torch.dtype, device=None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Position ids [1, fed + N] and an additive attention mask [1, 1, fed + N, past + fed + N] for a forward
    that feeds ``fed`` committed tokens (the last one pending) after ``past`` cached ones, then the N nodes."""
    n = len(parents)
    q = fed + n
    allowed = torch.zeros(q, past + q, dtype=torch.bool, device=device)
    # committed tokens: causal over the cache and each other
    allowed[:fed, : past + fed] = torch.ones(fed, past + fed, dtype=torch.bool, device=device).tril(diagonal=past)
    allowed[fed:, : past + fed] = True  # every node sees the whole committed context
    for i, parent in enumerate(parents):
        row = fed + i
        allowed[row, past + row] = True
        if parent >= 0:  # and whatever its parent sees among the nodes
            allowed[row, past + fed : past + q] |= allowed[fed + parent, past + fed : past + q]
    pending = past + fed - 1
    positions = list(range(past, past + fed)) + [pending + d for d in depths(parents)]
    mask = torch.zeros(q, past + q, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)
    return torch.tensor([positions], device=device), mask[None, None]
