"""Generation slots and fair admission.

A slot owns one decoder per drafter (decoders and drafters carry per-sequence state, so concurrent
generations never share them; the target's weights are shared). Requests wait for a free slot in FIFO
order (asyncio.Queue serves waiters first come, first served). At most ``slots + max_queue`` requests are
admitted at once; the next one is refused at once (HTTP 429) instead of waiting without bound.
"""

from __future__ import annotations

import asyncio
from typing import Callable

from ..engine import SpeculativeDecoder


class SlotPool:
    def __init__(self, make_slot: Callable[[], dict[str, SpeculativeDecoder]], slots: int, max_queue: int) -> None:
        if slots < 1:
            raise ValueError(f"max concurrency must be >= 1, got {slots}")
        if max_queue < 0:
            raise ValueError(f"max queue must be >= 0, got {max_queue}")
        self._slots = [make_slot() for _ in range(slots)]
        self._free: asyncio.Queue | None = None
        self.capacity = slots + max_queue
        self.admitted = 0
        self.waiting = 0

    def peek(self) -> dict[str, SpeculativeDecoder]:
        """One slot, for a look at its decoders (not taken)."""
        return self._slots[0]

    @property
    def size(self) -> int:
        return len(self._slots)

    @property
    def busy(self) -> int:
        """Slots generating now."""
        return self.size - (self._free.qsize() if self._free is not None else self.size)

    def _queue(self) -> asyncio.Queue:
        if self._free is None:  # created lazily inside the server's event loop
            self._free = asyncio.Queue()
            for slot in self._slots:
                self._free.put_nowait(slot)
        return self._free

    def reserve(self) -> bool:
        """Admit one more request if there is room (no await between check and update: atomic in the loop)."""
        if self.admitted >= self.capacity:
            return False
        self.admitted += 1
        return True

    def unreserve(self) -> None:
        self.admitted -= 1

    async def acquire(self) -> dict[str, SpeculativeDecoder]:
        self.waiting += 1
        try:
            return await self._queue().get()
        finally:
            self.waiting -= 1

    def release(self, slot: dict[str, SpeculativeDecoder]) -> None:
        self._queue().put_nowait(slot)
