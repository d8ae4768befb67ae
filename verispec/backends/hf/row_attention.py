"""Attention on verispec's native row kernel (``verispec.blockmm.attend``): the blocks backend's attention.

Each query row is computed alone over exactly the keys it sees, in the order a chain of one-token steps would have
them, by one C++ routine whose operations do not depend on the other rows, the thread count or the instruction set.
So a verify pass's rows are the bits of one-token steps, token-tree nodes those of the steps along their branch,
and batched rows those of their sequences alone, with no padding to key buckets and no Python loop over rows (the
float32 scheme of ``verispec.backends.hf.invariant`` it replaces in the blocks backend needed both). float32 only;
other dtypes, or a CPU without the native module, take ``width_invariant_attention``, and passes with any other mask
SDPA, as there.
"""

from __future__ import annotations

import functools

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ... import blockmm
from .invariant import RowKeys, width_invariant_attention, width_invariant_mask
from .masks import FULL, SLIDING

ROW_ATTENTION = "verispec_rows"


@functools.lru_cache(maxsize=64)
def _causal_counts(length: int, rows: int) -> torch.Tensor:
    """Keys each row sees in one sequence's plain causal pass: row i of the last ``rows`` sees length - rows + i + 1."""
    return torch.arange(length - rows + 1, length + 1, dtype=torch.int32)[None]


_last: tuple = ()  # ((RowKeys, layout), ...): the last pass's, one per kind of layer


def _layout(rows: RowKeys, batch: int, width: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(counts [batch, width], index [batch, width, keys] or None) for a pass laid out by ``RowKeys``; built once a
    pass per kind of layer (every layer of a kind asks with the same object, which fixes the pass's batch and
    width)."""
    global _last
    last = _last  # one read: another thread may replace it
    for last_rows, last_layout in last:
        if last_rows is rows:
            return last_layout
    if rows.lengths is not None:  # a batch: row r of sequence b sits at its position n_b - width + r
        lengths = torch.tensor(rows.lengths, dtype=torch.int32)[:, None]
        layout = (lengths - width + 1 + torch.arange(width, dtype=torch.int32)[None, :], None)
    else:
        widest = max(keys for keys, *_ in rows.groups)
        counts = torch.ones(batch, width, dtype=torch.int32)
        index = torch.zeros(batch, width, widest, dtype=torch.int32)
        for keys, b, i, columns, hidden in rows.groups:
            counts[b, i] = (~hidden).sum(-1).to(torch.int32)
            index[b, i, :keys] = columns.masked_fill(hidden, 0).to(torch.int32)
        layout = (counts, index)
    _last = last[-1:] + ((rows, layout),)  # the newest two
    return layout


@functools.lru_cache(maxsize=64)
def _window_layout(length: int, rows: int, window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A sliding-window layer's plain causal pass over one sequence: (counts [1, rows], index [1, rows, keys], the mask
    transformers builds for it [rows, length], True where a row sees a key). Row i, at position q = length - rows + i,
    sees the keys at positions q - window + 1 .. q (transformers' rule, ``hf.masks``), in order."""
    q = torch.arange(length - rows, length)
    start = (q - window + 1).clamp(min=0)
    counts = (q - start + 1).to(torch.int32)
    offsets = torch.arange(int(counts.max()))
    index = torch.minimum(start[:, None] + offsets[None], q[:, None]).to(torch.int32)  # past a row's count: unread
    keys = torch.arange(length)
    seen = (keys[None] <= q[:, None]) & (keys[None] >= start[:, None])
    return counts[None], index[None], seen


def _plain_window(attention_mask: torch.Tensor | None, length: int, rows: int, window: int):
    """(counts, index) for a one-sequence pass of a sliding-window layer whose mask is the plain causal one with the
    window (or None: transformers found the rule needs no mask); None for any other mask (trees, padding). A row's
    keys are the same at every width, and one-token steps take this path too, so its bits are theirs."""
    counts, index, seen = _window_layout(length, rows, window)
    if attention_mask is None:
        return counts, index
    if attention_mask.shape[-2:] != seen.shape or attention_mask.numel() != seen.numel():
        return None
    allowed = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
    return (counts, index) if torch.equal(allowed.reshape(seen.shape).cpu(), seen) else None


def row_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                  verispec_keys: RowKeys | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature; ``query`` [batch, heads, rows, dim], ``key`` / ``value``
    [batch, kv_heads, keys, dim]; returns [batch, rows, heads, dim]. ``verispec_keys`` may be a dict by layer type
    (``invariant.keys_by_layer``: a model with sliding-window layers), picked by the layer's ``sliding_window``."""
    window = getattr(module, "sliding_window", None)  # (transformers' sliding-window layers: None on full ones)
    if isinstance(verispec_keys, dict):
        verispec_keys = verispec_keys[SLIDING if window else FULL]
    elif window and verispec_keys is not None:  # keys laid out without the window: its explicit mask, on SDPA
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, dropout=dropout,
                                              scaling=scaling, **kwargs)
    if query.dtype != torch.float32 or key.dtype != torch.float32 or dropout or not blockmm.available():
        return width_invariant_attention(module, query, key, value, attention_mask, dropout, scaling,
                                         verispec_keys=verispec_keys, **kwargs)
    batch, _, rows, dim = query.shape
    scale = scaling if scaling is not None else dim ** -0.5
    layout = None
    if window and verispec_keys is None:
        layout = _plain_window(attention_mask, key.shape[2], rows, int(window)) if batch == 1 else None
        if layout is None:  # a tree's, a batch's or a padded mask without laid-out keys: the mask, on SDPA
            return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, dropout=dropout,
                                                  scaling=scaling, **kwargs)
    if layout is not None:
        counts, index = layout
    elif verispec_keys is not None:
        counts, index = _layout(verispec_keys, batch, rows)
    elif attention_mask is None and batch == 1:
        counts, index = _causal_counts(key.shape[2], rows), None
    else:
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, dropout=dropout,
                                              scaling=scaling, **kwargs)
    if key.stride(3) != 1 or value.stride(3) != 1:
        key, value = key.contiguous(), value.contiguous()
    # the layouts above are built right: the checks of blockmm.attend would cost more than a short row's arithmetic
    return blockmm.attend_unchecked(query, key, value, counts, index, scale), None


AttentionInterface.register(ROW_ATTENTION, row_attention)
AttentionMaskInterface.register(ROW_ATTENTION, width_invariant_mask)
