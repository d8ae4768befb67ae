"""One request's generation on the server: the job a request becomes, and the two ways it runs (inside the batch
engine, or unbatched in a worker thread of its own)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import anyio

from ..batching import BatchWorker
from ..engine import SpeculativeDecoder
from .pool import SlotPool

DONE = object()  # the end of a run's deltas


@dataclass
class Job:
    """One admitted request, ready to run on a slot."""

    endpoint: str
    decoder_name: str
    prompt_ids: list[int]
    options: dict[str, Any]
    disabled_by: str | None
    index: int = 0  # which of the request's samples (``n`` > 1)
    stream: Any = None


class ThreadedRun:
    """An unbatched generation: the decoder's own stream, stepped in a worker thread. Its slot is the caller's to
    give back (after ``close``)."""

    def __init__(self, slot: dict[str, SpeculativeDecoder]) -> None:
        self.slot = slot
        self.stream = None
        self.stats = None

    @property
    def result(self):
        return self.stream.result if self.stream is not None else None

    async def start(self, job: "Job") -> None:
        self.stream = self.slot[job.decoder_name].stream(job.prompt_ids, **job.options)
        self.stats = self.stream.stats
        self._steps = iter(self.stream)

    async def next(self):
        return await anyio.to_thread.run_sync(next, self._steps, DONE)

    def close(self) -> None:
        if self.stream is not None and self.stream.result is None:
            self.stream.close()  # not executing: the worker thread has returned


class BatchedRun:
    """A generation inside the batch engine: deltas arrive from the worker thread through an asyncio queue as
    ``(index, delta)``, then ``(index, DONE)`` (the samples of one request share one queue). Gives its slot back
    once the engine has dropped the sequence."""

    def __init__(self, worker: BatchWorker, slot: dict[str, SpeculativeDecoder], pool: SlotPool,
                 queue: asyncio.Queue, index: int = 0) -> None:
        self.worker, self.slot, self.pool = worker, slot, pool
        self.queue, self.index = queue, index
        self.seq = None
        self.stats = None
        self._released = False

    @property
    def result(self):
        return self.seq.result if self.seq is not None else None

    async def start(self, job: "Job") -> None:
        decoder = self.slot[job.decoder_name]
        request = decoder.request(job.prompt_ids, **job.options)  # InvalidRequest: a 400, before joining
        self.stats = request.stats
        loop = asyncio.get_running_loop()
        queue, index = self.queue, self.index

        def later(callback, *args) -> None:
            try:
                loop.call_soon_threadsafe(callback, *args)
            except RuntimeError:  # the event loop has closed (the server is stopping): nobody waits for this run
                pass

        def put(item) -> None:
            later(queue.put_nowait, (index, item))

        def done(seq) -> None:
            put(DONE)
            later(self._release)

        self.seq = self.worker.submit(decoder, request, on_delta=put, on_done=done)

    def _release(self) -> None:
        if not self._released:
            self._released = True
            self.pool.release(self.slot)

    def close(self) -> None:
        if self.seq is None:
            self._release()
        elif not (self.seq.result is not None or self.seq.error is not None):
            self.worker.cancel(self.seq)  # the slot comes back when the engine has dropped the sequence
