"""KV-cache rollback over transformers' public Cache API (no private attributes)."""

from __future__ import annotations

from transformers import Cache


def cache_length(cache: Cache | None) -> int:
    return 0 if cache is None else int(cache.get_seq_length())


def truncate(cache: Cache, length: int) -> None:
    """Keep the first ``length`` positions of ``cache`` and drop the rest (rejected draft tokens)."""
    current = cache_length(cache)
    if length > current:
        raise ValueError(f"cannot truncate a cache of {current} positions to {length}")
    if length < current:
        cache.crop(length - current)  # a negative argument removes that many positions from the end
