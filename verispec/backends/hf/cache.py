"""KV caches and rollback over transformers' public Cache API (no private attributes, no patched modules).

transformers' ``DynamicLayer`` grows by ``torch.cat`` on every step, copying the whole cache of every layer each
time: a cost that grows with the context (docs/kernels.md). ``GrowingLayer`` is a ``DynamicLayer`` whose
keys and values are views into a buffer with spare room: a step writes only its new positions, the buffer doubles
when full, and ``crop`` (inherited) shortens the view, so rollback still copies nothing.
"""

from __future__ import annotations

import torch
from transformers import Cache, DynamicLayer

MIN_CAPACITY = 256  # positions allocated at first; doubled whenever a step needs more


class GrowingLayer(DynamicLayer):
    """A layer cache of ``[batch, kv_heads, positions, head_dim]`` keys and values kept as views of a buffer."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None

    def _is_view_of_buffer(self) -> bool:
        buf = self._key_buffer
        return (buf is not None and self.keys is not None and self.keys.data_ptr() == buf.data_ptr()
                and self.keys.shape[:-2] == buf.shape[:-2] and self.keys.shape[-1] == buf.shape[-1])

    def _fits_buffer(self, key_states: torch.Tensor) -> bool:
        buf = self._key_buffer
        return (buf is not None and buf.shape[:-2] == key_states.shape[:-2] and buf.shape[-1] == key_states.shape[-1]
                and buf.dtype == key_states.dtype and buf.device == key_states.device)

    def _room(self, like: torch.Tensor, width: int, values_like: torch.Tensor | None = None) -> int:
        """Make the buffers hold this layer's positions with room for ``width`` more (``like``: new keys' shape but
        for their count, dtype and device; ``values_like`` the values', if they differ); returns the positions held."""
        values_like = like if values_like is None else values_like
        if not self.is_initialized:
            self.lazy_initialization(like, values_like)
        length = self.get_seq_length()
        need = length + width
        # the buffer still holds this layer's positions (an empty view after a crop to 0 may not share its pointer)
        ours = self._fits_buffer(like) and (length == 0 or self._is_view_of_buffer())
        if not ours or need > self._key_buffer.shape[-2]:
            # first use, full, or the layer's tensors were replaced (e.g. reordered): move into a new buffer,
            # doubling only when ours is full
            old = self._key_buffer.shape[-2] if ours else 0
            capacity = max(need, 2 * old, MIN_CAPACITY)
            keys = like.new_empty((*like.shape[:-2], capacity, like.shape[-1]))
            values = values_like.new_empty((*values_like.shape[:-2], capacity, values_like.shape[-1]))
            if length:
                keys[..., :length, :].copy_(self.keys)
                values[..., :length, :].copy_(self.values)
            self._key_buffer, self._value_buffer = keys, values
        return length

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        length = self._room(key_states, key_states.shape[-2], value_states)
        need = length + key_states.shape[-2]
        self._key_buffer[..., length:need, :].copy_(key_states)
        self._value_buffer[..., length:need, :].copy_(value_states)
        return self.filled(need)

    def slots(self, like: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor, list[int], int]:
        """Where a pass of ``width`` new positions writes, for a caller that writes them itself (the blocks
        backend's native layer step, ``verispec.backends.block_step``): the key and value buffers (every row of
        ``like``'s batch), each row's first column, and the columns the pass's attention reads. ``filled`` after."""
        keys, buffer = self.keys, self._key_buffer
        # the common case first, in a few reads: the layer's keys a view of its buffer, with room for the pass
        if (keys is not None and buffer is not None and keys.data_ptr() == buffer.data_ptr()
                and keys.shape[:-2] == like.shape[:-2] == buffer.shape[:-2] and buffer.dtype == like.dtype):
            length = keys.shape[-2]
            if length + width <= buffer.shape[-2] and keys.shape[-1] == buffer.shape[-1] == like.shape[-1]:
                return buffer, self._value_buffer, [length] * like.shape[0], length + width
        length = self._room(like, width)
        return self._key_buffer, self._value_buffer, [length] * like.shape[0], length + width

    def filled(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's keys and values are now the buffers' first ``end`` columns."""
        self.keys = self._key_buffer.narrow(-2, 0, end)  # views as [..., :end, :], for less work a layer and pass
        self.values = self._value_buffer.narrow(-2, 0, end)
        return self.keys, self.values

    def reset(self) -> None:
        super().reset()
        self._key_buffer = self._value_buffer = None


def new_cache() -> Cache:
    """An empty KV cache for a decoder model: ``GrowingLayer`` per layer, created as the model reaches it."""
    return Cache(layer_class_to_replicate=GrowingLayer)


def cache_length(cache: Cache | None) -> int:
    return 0 if cache is None else int(cache.get_seq_length())


class TorchKV:
    """One sequence's transformers cache behind the backend protocol (``verispec.backends.base.KVCache``)."""
    keeps_positions = True  # keep(start, positions) moves a tree's accepted path (KVCache)

    def __init__(self, cache: Cache | None = None) -> None:
        self.cache = new_cache() if cache is None else cache

    def __len__(self) -> int:
        return cache_length(self.cache)

    def truncate(self, length: int) -> None:
        truncate(self.cache, length)

    def keep(self, start: int, positions: list[int]) -> None:
        """Keep the first ``start`` positions and then ``positions`` (ascending, each >= ``start``), drop the rest."""
        compact(self.cache, start, positions)
        self.truncate(start + len(positions))

    def close(self) -> None:
        self.cache = new_cache()


def compact(cache: Cache, start: int, positions: list[int]) -> None:
    """Move the cached ``positions`` (ascending, each at or past ``start``) to follow the first ``start`` ones,
    in every layer (its public ``keys`` and ``values``, indexed by position); the caller then truncates to
    ``start + len(positions)``. A token tree's accepted path stays cached this way, its nodes' keys computed at
    the positions they now hold, instead of being fed again with the next pass."""
    if not positions or positions == list(range(start, start + len(positions))):
        return
    end, index = start + len(positions), None
    for layer in cache.layers:
        if index is None or index.device != layer.keys.device:  # one index for every layer (on their device)
            index = torch.tensor(positions, device=layer.keys.device)
        layer.keys[:, :, start:end] = layer.keys.index_select(2, index)
        layer.values[:, :, start:end] = layer.values.index_select(2, index)


def truncate(cache: Cache, length: int) -> None:
    """Keep the first ``length`` positions of ``cache`` and drop the rest (rejected draft tokens)."""
    current = cache_length(cache)
    if length > current:
        raise ValueError(f"cannot truncate a cache of {current} positions to {length}")
    if length < current:
        cache.crop(length - current)  # a negative argument removes that many positions from the end


class BatchKV:
    """Caches of up to ``capacity`` sequences in one set of key/value buffers, so that one forward can serve many
    sequences (``verispec.batching``): the transformers backend's ``KVGroup``.

    Layout ``[capacity, kv_heads, positions, head_dim]`` per layer, right-padded and ragged: sequence r's cached
    positions are columns [0, length_r) of its buffer row, at their own positions (RoPE is applied at the column
    index). A pass feeds W tokens per row (rows with fewer are padded); each row writes at its own columns
    [length_r, length_r + W), the attention mask lets a row's token at column c see columns <= c of its own row,
    and the row's length then grows by its real tokens only, so padding is left past the length, never read, and
    overwritten by the next pass. Rollback sets a length; nothing is copied. Rows of live sequences sit at buffer
    rows 0..n-1: when one is released, the last moves into its place (one copy of that sequence)."""

    rows_apart = True  # each sequence's keys and values in a row of its own: a kept cache takes no room from others

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a batch needs room for at least one sequence, got {capacity}")
        self.capacity = capacity
        self.rows: list[RowKV] = []  # live sequences, in buffer order
        self.cache = Cache(layer_class_to_replicate=lambda: RaggedLayer(self))
        self.pass_rows: slice | None = None  # buffer rows of the pass in progress
        self.pass_starts: torch.Tensor | None = None  # [rows] first column each row writes
        self.pass_end = 0  # columns the pass's attention reads
        self._index = None  # (key, where rows write) for the pass in progress

    def new_kv(self) -> "RowKV":
        if len(self.rows) >= self.capacity:
            raise RuntimeError(f"all {self.capacity} rows of this batch cache are in use")
        row = RowKV(self, len(self.rows))
        self.rows.append(row)
        return row

    def release(self, row: "RowKV") -> None:
        """Free a sequence's row (the last live row moves into it)."""
        if row.batch is not self or row.index is None:
            return
        index, last = row.index, self.rows[-1]
        if last is not row:
            for layer in self.cache.layers:
                layer.move(last.index, index, last.length)
            last.index = index
            self.rows[index] = last
        self.rows.pop()
        row.index = None

    def copy_prefix(self, source: "RowKV", target: "RowKV", length: int) -> None:
        """Copy the first ``length`` cached positions of ``source`` into the empty row ``target``."""
        if source.batch is not self or target.batch is not self or source.index is None or target.index is None:
            raise ValueError("both caches must be live rows of this batch")
        if len(target):
            raise ValueError(f"the target row already holds {len(target)} positions")
        if not 0 <= length <= len(source):
            raise ValueError(f"cannot copy {length} positions from a row of {len(source)}")
        for layer in self.cache.layers:
            layer.move(source.index, target.index, length)
        target.length = length

    def snapshot(self, row: "RowKV", length: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], int]:
        """A copy of ``row``'s first ``length`` positions out of the buffers (every layer's keys and values) and its
        size in bytes, for ``restore`` into another row after this one is given back."""
        if row.batch is not self or row.index is None or not 0 <= length <= len(row):
            raise ValueError(f"cannot copy {length} positions out of this row")
        copied = [(layer._keys[row.index, :, :length].clone(), layer._values[row.index, :, :length].clone())
                  for layer in self.cache.layers]  # a row holding positions: every layer has its buffers
        return copied, sum(k.numel() * k.element_size() * 2 for k, _ in copied)

    def restore(self, copied: list[tuple[torch.Tensor, torch.Tensor]], target: "RowKV", length: int) -> None:
        """Write the first ``length`` positions of a ``snapshot`` into the empty row ``target``."""
        if target.batch is not self or target.index is None or len(target):
            raise ValueError("the target must be an empty live row of this batch")
        if len(copied) != len(self.cache.layers) or not 0 <= length <= copied[0][0].shape[-2]:
            raise ValueError(f"this copy does not hold {length} positions of this batch's layers")
        for layer, (keys, values) in zip(self.cache.layers, copied):
            layer._ensure(keys[None], length)
            layer._keys[target.index, :, :length].copy_(keys[:, :length])
            layer._values[target.index, :, :length].copy_(values[:, :length])
        target.length = length

    def begin_pass(self, rows: list["RowKV"], width: int) -> tuple[slice, torch.Tensor]:
        """Set up a pass of ``width`` tokens per row over ``rows``; returns the buffer rows it covers (rows of the
        range not in ``rows`` join as padding: they write past their length only) and their start columns."""
        indices = [r.index for r in rows]
        if any(i is None for i in indices):
            raise ValueError("a released batch row cannot take part in a pass")
        span = slice(min(indices), max(indices) + 1)
        starts = torch.tensor([r.length for r in self.rows[span]], dtype=torch.long)
        self.pass_rows, self.pass_starts = span, starts
        self.pass_end = int(starts.max()) + width
        return span, starts

    def write_index(self, heads: int, width: int):
        """Where the pass's rows write: one start column shared by all rows, or an index for ``index_put_``
        (built once per pass, not per layer)."""
        if self._index is None or self._index[0] != (heads, width):
            starts, span = self.pass_starts, self.pass_rows
            if bool((starts == starts[0]).all()):
                index = int(starts[0])
            else:
                index = (torch.arange(span.start, span.stop)[:, None, None], torch.arange(heads)[None, :, None],
                         (starts[:, None] + torch.arange(width))[:, None, :])
            self._index = ((heads, width), index)
        return self._index[1]

    def end_pass(self) -> None:
        self.pass_rows = self.pass_starts = None
        self.pass_end = 0
        self._index = None


class RowKV:
    """One sequence's cache inside a ``BatchKV`` (its ``KVCache``)."""
    keeps_positions = False  # no keep(): a tree step is fed again (KVCache)

    def __init__(self, batch: BatchKV, index: int) -> None:
        self.batch: BatchKV | None = batch
        self.index: int | None = index
        self.length = 0

    def __len__(self) -> int:
        return self.length

    def truncate(self, length: int) -> None:
        if length > self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} positions to {length}")
        self.length = length

    def close(self) -> None:
        if self.batch is not None:
            self.batch.release(self)
            self.batch = None


class RaggedLayer(DynamicLayer):
    """One layer of a ``BatchKV``: writes each row's new keys/values at that row's own columns."""

    def __init__(self, batch: BatchKV) -> None:
        super().__init__()
        self.batch = batch
        self._keys: torch.Tensor | None = None
        self._values: torch.Tensor | None = None

    def _ensure(self, like: torch.Tensor, columns: int) -> None:
        """Buffers with room for ``columns`` columns and for every live row (rows 0..n-1). Both grow by doubling:
        rows only up to the batch's capacity as sequences join, so a server serving one request zeroes and copies
        one row's buffers, not its capacity's (docs/serving.md)."""
        have = 0 if self._keys is None else self._keys.shape[-2]
        height = 0 if self._keys is None else self._keys.shape[0]
        rows = max(1, len(self.batch.rows))
        if columns <= have and rows <= height:
            return
        capacity = max(columns, 2 * have, MIN_CAPACITY) if columns > have else have
        taller = min(self.batch.capacity, max(rows, 2 * height)) if rows > height else height
        shape = (taller, like.shape[1], capacity, like.shape[-1])
        keys, values = like.new_zeros(shape), like.new_zeros(shape)
        if have:
            keys[:height, :, :have].copy_(self._keys)
            values[:height, :, :have].copy_(self._values)
        self._keys, self._values = keys, values

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        batch = self.batch
        span, starts, end = batch.pass_rows, batch.pass_starts, batch.pass_end
        self._ensure(key_states, end)
        index = batch.write_index(key_states.shape[1], key_states.shape[-2])
        if isinstance(index, int):  # every row starts at the same column: a plain slice copy
            self._keys[span, :, index : index + key_states.shape[-2]].copy_(key_states)
            self._values[span, :, index : index + key_states.shape[-2]].copy_(value_states)
        else:
            self._keys.index_put_(index, key_states)
            self._values.index_put_(index, value_states)
        return self.filled(end)

    def slots(self, like: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor, list[int], int]:
        """As ``GrowingLayer.slots``: the buffers' rows of the pass, each row's first column, the columns read."""
        if not self.is_initialized:
            self.lazy_initialization(like, like)
        batch = self.batch
        self._ensure(like, batch.pass_end)
        span = batch.pass_rows
        return self._keys[span], self._values[span], batch.pass_starts.tolist(), batch.pass_end

    def filled(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        span = self.batch.pass_rows
        self.keys = self._keys[span, :, :end]
        self.values = self._values[span, :, :end]
        return self.keys, self.values

    def move(self, source: int, target: int, length: int) -> None:
        if self._keys is not None:
            self._ensure(self._keys, self._keys.shape[-2])  # the target row may have joined since the last pass
            self._keys[target, :, :length].copy_(self._keys[source, :, :length])
            self._values[target, :, :length].copy_(self._values[source, :, :length])

    def get_seq_length(self) -> int:
        starts = self.batch.pass_starts
        return 0 if starts is None else int(starts.max())
