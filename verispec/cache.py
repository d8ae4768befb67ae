"""KV caches and rollback over transformers' public Cache API (no private attributes, no patched modules).

transformers' ``DynamicLayer`` grows by ``torch.cat`` on every step, copying the whole cache of every layer each
time (the profiler put ``aten::cat`` at 12% of a one-token step of the default model on an AMD EPYC; replacing it
saved ~2 ms of ~60 ms at 300 cached tokens, more as the context grows). ``GrowingLayer`` is a ``DynamicLayer`` whose
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

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = self.get_seq_length()
        need = length + key_states.shape[-2]
        # the buffer still holds this layer's positions (an empty view after a crop to 0 may not share its pointer)
        ours = self._fits_buffer(key_states) and (length == 0 or self._is_view_of_buffer())
        if not ours or need > self._key_buffer.shape[-2]:
            # first use, full, or the layer's tensors were replaced (e.g. reordered): move into a new buffer,
            # doubling only when ours is full
            old = self._key_buffer.shape[-2] if ours else 0
            capacity = max(need, 2 * old, MIN_CAPACITY)
            shape = (*key_states.shape[:-2], capacity, key_states.shape[-1])
            keys = key_states.new_empty(shape)
            values = value_states.new_empty((*value_states.shape[:-2], capacity, value_states.shape[-1]))
            if length:
                keys[..., :length, :].copy_(self.keys)
                values[..., :length, :].copy_(self.values)
            self._key_buffer, self._value_buffer = keys, values
        self._key_buffer[..., length:need, :].copy_(key_states)
        self._value_buffer[..., length:need, :].copy_(value_states)
        self.keys = self._key_buffer[..., :need, :]
        self.values = self._value_buffer[..., :need, :]
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
    """One sequence's transformers cache behind the backend protocol (``verispec.backend.KVCache``)."""

    def __init__(self, cache: Cache | None = None) -> None:
        self.cache = new_cache() if cache is None else cache

    def __len__(self) -> int:
        return cache_length(self.cache)

    def truncate(self, length: int) -> None:
        truncate(self.cache, length)


def truncate(cache: Cache, length: int) -> None:
    """Keep the first ``length`` positions of ``cache`` and drop the rest (rejected draft tokens)."""
    current = cache_length(cache)
    if length > current:
        raise ValueError(f"cannot truncate a cache of {current} positions to {length}")
    if length < current:
        cache.crop(length - current)  # a negative argument removes that many positions from the end
