"""Explicit attention masks for models whose layers do not all attend alike (sliding-window layers).

The backend passes transformers an explicit additive mask wherever its own would be wrong: token trees, rows of a
batch at their own positions, the fixed-buffer cache's stale columns. transformers uses an explicit 4D mask as it
is, for every layer, so for a model with sliding-window layers (Gemma 2 and 3, Mistral, Qwen2 with windows on) the
mask must also hide, in those layers, the keys a window or more behind each query (transformers' own rule: a query
at position q sees keys at positions > q - window). Measured before this existed (tests/test_zoo.py, a 4-layer
Gemma 3 with a 6-token window): tree and batched passes past the window were off by up to 2.5 in the logits.
"""

from __future__ import annotations

import torch

SLIDING = "sliding_attention"
FULL = "full_attention"


def sliding_window(config) -> int | None:
    """The window of the model's sliding-window layers, or None when every layer attends to all earlier positions."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if not window or (types is not None and SLIDING not in types):
        return None
    return int(window)


def for_layers(config, mask: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor):
    """The ``attention_mask`` argument for the additive ``mask`` [batch, 1, queries, keys]: the mask itself when every
    layer attends alike; else, for the sliding layers, the mask with keys at positions <= query - window hidden too
    (a dict by layer type where the config names layer types, the windowed mask alone where every layer slides).
    ``query_positions`` is [queries] or [batch, queries], ``key_positions`` [keys] or [batch, keys]."""
    window = sliding_window(config)
    if window is None:
        return mask
    far = key_positions.unsqueeze(-2) <= query_positions.unsqueeze(-1) - window  # [(batch,) queries, keys]
    windowed = mask.masked_fill(far.reshape(-1, 1, *far.shape[-2:]), torch.finfo(mask.dtype).min)
    types = getattr(config, "layer_types", None)
    if types is None:
        return windowed
    # in a fixed order: a compiled step takes the dict as inputs in the order it was exported with, and a set's
    # order changes with each process's string hashing (a stored Gemma 3 step then got its masks swapped)
    return {kind: windowed if kind == SLIDING else mask for kind in sorted(set(types))}
