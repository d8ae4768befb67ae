"""bfloat16 passes whose rows do not depend on the pass width: greedy speculation token-identical to plain decoding.

A position's logits must come out bit for bit the same whether the position is computed in a one-token step or as
one row of a wide verify pass; otherwise greedy speculation can flip an argmax that plain decoding would not. In
float32 the rows differ by ~1e-6 (identity is measured, not promised); in bfloat16 by up to 0.5 in the logits
(docs/kernels.md), which flips tokens. Two parts of the default model's pass depend on the width there
(``experiments/width_invariance.py``, ``experiments/linear_width_identity.py``):

* SDPA: its split of the keys and queries into blocks depends on how many rows the pass has;
* the packed linears' one-row path: a row computed alone (M = 1) can differ from the same row in a product of two or
  more rows (seen in ``down_proj``); any M >= 2 agreed.

So, for plain causal passes (one sequence, no explicit mask):

* attention runs as two matmuls and a softmax over a key length fixed by the row's position alone: rows attend over
  the keys up to the next multiple of ``BUCKET`` (the keys past the row's position masked to -inf, padded with
  zeros past the cache), grouped so that rows of one bucket share one product of at least 3 rows (the query heads
  that share a KV head: a product never runs the one-row path);
* a packed linear given one row computes two copies of it and keeps one (``PackedLinear.one_row_as_two``), which
  costs nearly nothing in a pass bound by streaming the weights; given more than ``ROWS_AT_ONCE`` rows it runs
  products of at most that many (``PackedLinear.rows_at_once``): oneDNN takes another kernel for wider products
  (AMX tiles on Sapphire Rapids past 32 rows: a batch of five sequences verifying 7 tokens each, a prefill of 51
  tokens), which rounds rows otherwise.

Passes whose rows see other keys than the plain causal rule gives them (token trees: a node sees the context and
its ancestors; the rows of a batch, each sequence at its own length) say which in ``RowKeys``, built once per pass
by the backend: every row's keys are gathered into the layout a plain pass at the row's position would have (the
keys it sees in order, zeros up to its bucket) and attended as in a one-token step, the rows of a bucket in one
batched product. So a tree node's logits are those of the one-token steps along its branch, and a batched row's
those of its sequence alone.

Every row is bitwise equal to a chain of one-token passes, where SDPA's rows differ visibly (docs/kernels.md); token trees and batched rows equal to their chains and lone
sequences (tests/test_invariant.py, tests/test_e2e_kernels.py). Passes with any other mask (padded batches such as
train-eagle's answer generation) take SDPA. Models with sliding-window layers keep SDPA (they need transformers'
per-layer masks), and so does a CPU whose kernels fail the probe (``kernels_are_width_invariant``: other CPUs may
pick other blockings).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .masks import FULL, SLIDING, sliding_window
from ..torch_cpu.packing import PackedLinear

WIDTH_INVARIANT_ATTENTION = "verispec_width_invariant"
BUCKET = 256  # keys a row attends over: its position rounded up to a multiple of this
ROWS_AT_ONCE = 32  # the widest packed bfloat16 product run at once (module doc)


def _groups(length: int, rows: int) -> list[tuple[int, int, int]]:
    """(first row, end row, key length) for each run of rows of one bucket; row i sits at position length - rows + i."""
    first = length - rows
    out: list[tuple[int, int, int]] = []
    for i in range(rows):
        keys = ((first + i) // BUCKET + 1) * BUCKET
        if out and out[-1][2] == keys:
            out[-1] = (out[-1][0], i + 1, keys)
        else:
            out.append((i, i + 1, keys))
    return out


@functools.lru_cache(maxsize=8)
def _hidden(first: int, rows: int, groups: int, keys: int, device: torch.device) -> torch.Tensor:
    """[groups * rows, keys] bool: True where a key lies past the row's position (rows at first .. first + rows - 1,
    repeated per query head of a group). Every layer of a pass asks for the same one: built once."""
    positions = torch.arange(first, first + rows, device=device).repeat(groups)
    return torch.arange(keys, device=device)[None, :] > positions[:, None]


@dataclass(frozen=True)
class RowKeys:
    """The keys each row of a pass sees, for passes the plain causal rule does not describe (token trees, the rows of
    a batch at their own positions): per bucket, the rows (``b``, ``i``: batch row and query row) whose position
    falls in it and, for each, the key columns it sees in the order a chain of one-token steps would have them
    (``index`` [n, keys]; the column past the pass's keys stands for a zero key) and which of them lie past its
    position (``hidden`` [n, keys]). Built once per pass (``row_keys``), read by every layer."""

    groups: tuple[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], ...]
    lengths: tuple[int, ...] | None = None  # every row causal in its own sequence (a batch): each one's key length


def keys_by_layer(config, allowed: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor):
    """``row_keys(allowed)`` ([batch, rows, keys]) for a model whose layers attend alike; for one with sliding-window
    layers, {"full_attention": that, "sliding_attention": the same with the keys a window or more behind each query
    hidden} (``query_positions`` [batch, rows], ``key_positions`` [keys]; transformers' rule, ``masks``): the row
    attention picks by the layer's ``sliding_window``."""
    allowed = allowed.cpu()
    window = sliding_window(config)
    if window is None:
        return row_keys(allowed)
    far = key_positions.cpu()[None, None, :] <= query_positions.cpu()[..., None] - window
    return {FULL: row_keys(allowed), SLIDING: row_keys(allowed & ~far)}


def row_keys(allowed: torch.Tensor) -> RowKeys:
    """``RowKeys`` from ``allowed`` [batch, rows, keys] (True where a row sees a key). A row that sees n keys is laid
    out as position n - 1 of a sequence: the keys it sees, in column order, then zeros up to its bucket."""
    batch, rows, length = allowed.shape
    positions = (allowed.sum(-1) - 1).clamp_(min=0)  # [batch, rows]
    last = positions[:, -1:] + 1
    causal = torch.arange(length)[None, None, :] <= (last - rows + torch.arange(rows)[None, :])[:, :, None]
    if rows > 1 and torch.equal(allowed, causal):
        # each sequence's rows are its last ones, each seeing all before it: attended per sequence, nothing gathered
        # (with one row a sequence, one gathered product for all of them costs less Python than a loop)
        return RowKeys((), tuple(last[:, 0].tolist()))
    buckets = (positions // BUCKET + 1) * BUCKET
    widest = int(buckets.max())
    # the columns each row sees first, in order (a stable sort of "hidden"), then the zero key's column
    order = torch.argsort((~allowed).to(torch.uint8), dim=-1, stable=True)
    if widest > length:
        order = torch.cat([order, order.new_full((batch, rows, widest - length), length)], dim=-1)
    groups = []
    for keys in buckets.unique().tolist():
        b, i = (buckets == keys).nonzero(as_tuple=True)
        hidden = torch.arange(keys)[None, :] > positions[b, i][:, None]
        index = order[b, i, :keys].masked_fill(hidden, length)
        groups.append((keys, b, i, index, hidden))
    return RowKeys(tuple(groups))


def _causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """One sequence under the plain causal rule: ``query`` [1, heads, rows, dim] for the last rows of ``key`` /
    ``value`` [1, kv_heads, length, dim]; each bucket's rows in one product over the bucket's keys."""
    _, heads, rows, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    out = query.new_empty(1, rows, heads, dim)
    runs = _groups(length, rows)
    if query.dtype == torch.float32:
        # float32 products (MKL) round a row otherwise when it shares a product with other rows: each row is
        # computed as a one-token step computes it, alone (the blocks backend's passes; bfloat16 ones keep the
        # cheaper shared product, which the probe checks)
        runs = [(i, i + 1, keys) for start, end, keys in runs for i in range(start, end)]
    laid: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # each bucket's keys and values, laid out once
    for start, end, keys in runs:
        if keys not in laid:
            k, v = key[0], value[0]
            if keys > length:
                k = nn.functional.pad(k, (0, 0, 0, keys - length))
                v = nn.functional.pad(v, (0, 0, 0, keys - length))
            else:  # contiguous, as a padded one is: a one-token step at a row's position pads its bucket
                k, v = k[:, :keys].contiguous(), v[:, :keys].contiguous()
            laid[keys] = k, v
        k, v = laid[keys]
        m = end - start
        # the query heads sharing KV head j are heads j*groups .. j*groups + groups - 1 (transformers' repeat_kv)
        q = query[0, :, start:end].reshape(kv_heads, groups * m, dim)
        scores = torch.matmul(q, k.transpose(1, 2)).float() * scale  # [kv_heads, groups * m, keys]
        hidden = _hidden(length - rows + start, m, groups, keys, query.device)
        probs = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1).to(v.dtype)
        o = torch.matmul(probs, v)  # [kv_heads, groups * m, dim]
        out[0, start:end] = o.reshape(kv_heads, groups, m, dim).permute(2, 0, 1, 3).reshape(m, heads, dim)
    return out


def _attention_by_rows(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rows: RowKeys,
                       scale: float) -> torch.Tensor:
    """``width_invariant_attention`` for rows laid out by ``RowKeys``: each row's keys gathered into the layout of a
    plain causal pass, one product per row and KV head (the query heads sharing it as its rows, as in a one-token
    step), every row of a bucket in one batched product. The gather is the cost (a copy of each row's keys and
    values): one ``index_select`` per bucket straight into the products' layout, KV head major."""
    batch, heads, width, dim = query.shape
    if rows.lengths is not None:  # a batch: each sequence as a plain causal pass of its own, no keys copied
        return torch.cat([_causal_attention(query[b : b + 1], key[b : b + 1, :, :n], value[b : b + 1, :, :n], scale)
                          for b, n in enumerate(rows.lengths)])
    kv_heads, length = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    zero = key.new_zeros(batch, kv_heads, 1, dim)
    # [kv_heads, batch * (columns + 1), dim]: every sequence's columns, then its zero key
    keys_by_column = torch.cat([key, zero], dim=2).transpose(0, 1).reshape(kv_heads, -1, dim)
    values_by_column = torch.cat([value, zero], dim=2).transpose(0, 1).reshape(kv_heads, -1, dim)
    out = query.new_empty(batch, width, heads, dim)
    for keys, b, i, index, hidden in rows.groups:
        n = len(b)
        flat = (b[:, None] * (length + 1) + index).reshape(-1)
        k = keys_by_column.index_select(1, flat).view(kv_heads * n, keys, dim)
        v = values_by_column.index_select(1, flat).view(kv_heads * n, keys, dim)
        # query heads j*groups .. j*groups + groups - 1 share KV head j (transformers' repeat_kv)
        q = query[b, :, i].view(n, kv_heads, groups, dim).transpose(0, 1).reshape(kv_heads * n, groups, dim)
        scores = torch.bmm(q, k.transpose(1, 2)).float() * scale  # [kv_heads * n, groups, keys]
        masked = hidden[None, :, None, :].expand(kv_heads, n, groups, keys).reshape(kv_heads * n, groups, keys)
        probs = torch.softmax(scores.masked_fill(masked, float("-inf")), dim=-1).to(v.dtype)
        o = torch.bmm(probs, v).view(kv_heads, n, groups, dim).transpose(0, 1).reshape(n, heads, dim)
        out[b, i] = o
    return out


def width_invariant_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                              verispec_keys: RowKeys | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """Causal attention whose rows do not depend on how many rows the pass has (module doc). ``query`` [batch,
    heads, rows, dim], ``key``/``value`` [batch, kv_heads, cached + rows, dim]; returns [batch, rows, heads, dim] as
    transformers' attention functions do. One sequence under the plain causal rule needs nothing more; a pass
    whose rows see other keys (token trees, rows of a batch) says which in ``verispec_keys`` (``row_keys``), and
    its ``attention_mask`` is then only for other attention functions."""
    batch, heads, rows, dim = query.shape
    if verispec_keys is not None and not dropout:
        return _attention_by_rows(query, key, value, verispec_keys,
                                  scaling if scaling is not None else dim ** -0.5), None
    if attention_mask is not None or batch != 1 or dropout:
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, dropout=dropout,
                                              scaling=scaling, **kwargs)
    return _causal_attention(query, key, value, scaling if scaling is not None else dim ** -0.5), None


def width_invariant_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                         mask_function=causal_mask_function, attention_mask: torch.Tensor | None = None, **kwargs):
    """transformers' mask for this attention: None for one unpadded sequence under the plain causal rule (the
    attention masks itself, by position); otherwise SDPA's mask, which sends the pass to SDPA (padded batches such
    as train-eagle's answer generation, packed sequences)."""
    unpadded = attention_mask is None or bool(attention_mask.all())
    if (batch_size == 1 and unpadded and mask_function is causal_mask_function and kv_offset == 0
            and q_offset + q_length == kv_length):
        return None
    return sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask, **kwargs)


AttentionInterface.register(WIDTH_INVARIANT_ATTENTION, width_invariant_attention)
AttentionMaskInterface.register(WIDTH_INVARIANT_ATTENTION, width_invariant_mask)


@functools.cache
def kernels_are_width_invariant() -> bool:
    """Probe, once per process, that this CPU's kernels keep rows independent of the width as the scheme needs: a
    packed bfloat16 linear (1,536 -> 576, one row computed as two) and the attention above (9 query heads on 3 KV
    heads of 64, 300 cached keys), each width's rows, and rows whose keys are gathered (``RowKeys``), against the
    rows computed alone, bitwise. Another CPU may pick other kernels (AMX tiles, other blockings); where the probe
    fails bfloat16 passes keep SDPA."""
    gen = torch.Generator().manual_seed(0)
    try:
        with torch.inference_mode():
            linear = PackedLinear(torch.randn(576, 1536, generator=gen).to(torch.bfloat16))
            linear.one_row_as_two, linear.rows_at_once = True, ROWS_AT_ONCE
            x = torch.randn(1, 2 * ROWS_AT_ONCE + 5, 1536, generator=gen).to(torch.bfloat16)
            full = linear(x)
            widths = (1, 2, 3, 5, 9, 17, ROWS_AT_ONCE, ROWS_AT_ONCE + 1, ROWS_AT_ONCE + 7, 2 * ROWS_AT_ONCE + 1)
            if not all(torch.equal(linear(x[:, :w]), full[:, :w]) for w in widths):
                return False
            if not all(torch.equal(linear(x[:, w:]), full[:, w:]) for w in (1, 7)):  # rows that start elsewhere
                return False
            q = torch.randn(1, 9, 9, 64, generator=gen).to(torch.bfloat16)
            k, v = (torch.randn(1, 3, 309, 64, generator=gen).to(torch.bfloat16) for _ in range(2))
            alone = [width_invariant_attention(None, q[:, :, i : i + 1], k[:, :, : 301 + i], v[:, :, : 301 + i],
                                               None)[0][0, 0] for i in range(9)]
            for w in (2, 4, 9):
                out = width_invariant_attention(None, q[:, :, :w], k[:, :, : 300 + w], v[:, :, : 300 + w], None)[0]
                if not all(torch.equal(out[0, i], alone[i]) for i in range(w)):
                    return False
            # rows laid out by RowKeys (tree nodes, batch rows): row i sees the 300 keys, then new keys at every
            # other column, with keys it must not see between them
            spread_k, spread_v = (torch.randn(1, 3, 318, 64, generator=gen).to(torch.bfloat16) for _ in range(2))
            spread_k[:, :, :300], spread_v[:, :, :300] = k[:, :, :300], v[:, :, :300]
            spread_k[:, :, 300::2], spread_v[:, :, 300::2] = k[:, :, 300:309], v[:, :, 300:309]
            allowed = torch.zeros(1, 9, 318, dtype=torch.bool)
            allowed[:, :, :300] = True
            for i in range(9):
                allowed[0, i, 300 : 301 + 2 * i : 2] = True
            out = width_invariant_attention(None, q, spread_k, spread_v, None, verispec_keys=row_keys(allowed))[0]
            if not all(torch.equal(out[0, i], alone[i]) for i in range(9)):
                return False
    except (RuntimeError, NotImplementedError):
        return False
    return True


def supported(model: nn.Module, dtype: torch.dtype) -> bool:
    """Whether ``make_width_invariant`` applies: bfloat16 on CPU, packed linears, one kind of attention layer, and
    kernels that pass ``kernels_are_width_invariant`` on this CPU."""
    config = model.config
    return (dtype == torch.bfloat16 and next(model.parameters()).device.type == "cpu"
            and any(isinstance(m, PackedLinear) for m in model.modules())
            and sliding_window(config) is None and not getattr(config, "attn_logit_softcapping", None)
            and kernels_are_width_invariant())


def make_width_invariant(model: nn.Module) -> bool:
    """Switch a loaded bfloat16 CPU model to width-invariant passes (attention and one-row linears); returns whether
    it applied (``supported``)."""
    if not supported(model, next(model.parameters()).dtype):
        return False
    model.set_attn_implementation(WIDTH_INVARIANT_ATTENTION)
    for module in model.modules():
        if isinstance(module, PackedLinear):
            module.one_row_as_two, module.rows_at_once = True, ROWS_AT_ONCE
    return True
