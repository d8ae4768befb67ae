"""What a long training run keeps between stops, and how it keeps to a time budget.

A run writes ``checkpoint.pt`` into its output folder at every validation and when it stops: the trainable weights,
the optimiser state, the step reached, the seconds trained, and the record so far. Ctrl-C or a SIGTERM stops a
run at the end of the step in progress, with a checkpoint. ``--resume`` reads it, replays the seeded batch order up
to that step (no batch is seen twice or skipped), and goes on; the settings that shape the schedule must be the same.

``--max-minutes`` makes the learning-rate schedule run on whichever ends first, the steps or the minutes: the cosine
decay's progress is the larger of the share of steps done and the share of the time used, and the run ends (its
schedule complete) when either is spent. So a run on an unknown machine uses its whole budget and still ends at the
low learning rate. (Fitting a step count from the pace of the first steps was tried first: on a GPU the first
hundred steps of new batch shapes are several times slower, and the fitted runs stopped at 40% of their time.)
"""

from __future__ import annotations

import math
import signal
import threading
import time
from pathlib import Path
from typing import Iterator

import torch

from ..errors import InvalidRequest

CHECKPOINT = "checkpoint.pt"
# the settings a resumed run must share with the run it continues (others, such as the device, may change)
SCHEDULE_KEYS = ("epochs", "lr", "warmup_steps", "batch_tokens", "seed", "ttt_steps", "draft_vocab_size",
                 "val_sequences", "prompt_loss", "num_heads", "layers", "feature_layers", "max_minutes", "text")


def save_checkpoint(folder: str | Path, state: dict) -> Path:
    """Write ``state`` (tensors and plain values) to ``folder/checkpoint.pt`` atomically."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / CHECKPOINT
    partial = path.with_suffix(".partial")
    torch.save(state, partial)
    partial.replace(path)  # an interrupted write never replaces a good checkpoint
    return path


def load_checkpoint(folder: str | Path, settings: dict) -> dict:
    """The checkpoint in ``folder``, checked against this run's ``settings``; a clear error when there is none or it
    was written with another schedule."""
    path = Path(folder) / CHECKPOINT
    if not path.exists():
        raise InvalidRequest(f"--resume: {path} does not exist; start without --resume (a run writes it at every "
                             "validation and when it stops)")
    state = torch.load(path, map_location="cpu", weights_only=True)  # tensors and plain values: no code runs
    old = state.get("settings", {})
    changed = [f"{k}: {old.get(k)!r} -> {settings.get(k)!r}" for k in SCHEDULE_KEYS
               if k in settings and old.get(k) != settings.get(k)]
    if changed:
        raise InvalidRequest(f"--resume: {path} was written with other settings ({'; '.join(changed)}); resume with "
                             "the same ones or start afresh in another --out folder")
    return state


def bf16_autocast(setting: bool | None, device: torch.device) -> bool:
    """Whether training runs under bfloat16 autocast: ``setting`` when given; else (auto) on a GPU, and on a CPU only
    where it multiplies bfloat16 natively. Elsewhere autocast emulates bfloat16 through float32, and a training step
    is many times slower than in float32 (docs/kernels.md)."""
    if setting is not None:
        return bool(setting)
    if device.type != "cpu":
        return True
    from ..backends.torch_cpu.cpu import bfloat16_dot_products

    return bfloat16_dot_products()


def scheduled_batches(make_epoch, epochs: int, start_step: int) -> Iterator[tuple[int, int, list]]:
    """(epoch, step, batch) for every step from ``start_step`` on. ``make_epoch()`` returns one epoch's batches and is
    called once per epoch from the first, so the seeded order is the same whether a run resumes or not."""
    step = 0
    for epoch in range(epochs):
        for batch in make_epoch():
            if step >= start_step:
                yield epoch, step, batch
            step += 1


class Schedule:
    """Warm-up then cosine decay to a tenth of the peak, over ``total`` steps or ``minutes`` of training (whichever
    ends first; ``seconds`` already trained count, for a resumed run)."""

    def __init__(self, peak: float, total: int, warmup: int, minutes: float | None = None, seconds: float = 0.0):
        self.peak, self.total, self.warmup, self.minutes = peak, max(1, total), warmup, minutes
        self._before = seconds
        self._start = time.perf_counter()

    def seconds(self) -> float:
        return self._before + time.perf_counter() - self._start

    def progress(self, step: int) -> float:
        """Share of the schedule done: steps, or time when --max-minutes is set and runs out sooner."""
        share = (step - self.warmup) / max(1, self.total - self.warmup) if step >= self.warmup else 0.0
        if self.minutes:
            share = max(share, self.seconds() / (60.0 * self.minutes))
        return min(1.0, share)

    def lr(self, step: int) -> float:
        if step < self.warmup:
            return self.peak * (step + 1) / self.warmup
        return self.peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * self.progress(step))))

    def done(self, step: int) -> bool:
        return step >= self.total or self.progress(step) >= 1.0


class StopSignals:
    """Within ``with``: Ctrl-C (SIGINT) and SIGTERM set ``requested`` instead of killing the run, which then stops
    after the step in progress and writes its checkpoint. A second Ctrl-C interrupts at once. Outside the main
    thread (where handlers cannot be set) it does nothing."""

    def __init__(self) -> None:
        self.requested = False
        self._old: dict = {}

    def _handle(self, signum, frame) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                if signal.getsignal(sig) is None:  # a handler installed outside Python: leave it alone
                    continue
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
