"""Generation slots and fair admission.

A slot owns one decoder per drafter (decoders and drafters carry per-sequence state, so concurrent
generations never share them; the target's weights are shared). Requests wait for free slots in FIFO
order (asyncio.Queue serves waiters first come, first served); a request for several samples (``n`` > 1) takes its
slots together, one request at a time, so two such requests never each hold part of what they need. At most
``slots + max_queue`` samples are admitted at once; the next request is refused at once (HTTP 429) instead of
waiting without bound.
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
        self._taking: asyncio.Lock | None = None
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

    def reserve(self, n: int = 1) -> bool:
        """Admit a request of ``n`` samples if there is room (no await between check and update: atomic in the
        loop)."""
        if self.admitted + n > self.capacity:
            return False
        self.admitted += n
        return True

    def unreserve(self, n: int = 1) -> None:
        self.admitted -= n

    async def acquire(self, n: int = 1) -> list[dict[str, SpeculativeDecoder]]:
        """``n`` slots, taken together (requests in arrival order)."""
        if n > self.size:
            raise ValueError(f"{n} slots asked of a pool of {self.size}")
        if self._taking is None:
            self._taking = asyncio.Lock()
        self.waiting += 1
        taken: list[dict[str, SpeculativeDecoder]] = []
        try:
            async with self._taking:
                while len(taken) < n:
                    taken.append(await self._queue().get())
            return taken
        except BaseException:
            for slot in taken:  # cancelled while waiting: give back what was taken
                self.release(slot)
            raise
        finally:
            self.waiting -= 1

    def release(self, slot: dict[str, SpeculativeDecoder]) -> None:
        self._queue().put_nowait(slot)
