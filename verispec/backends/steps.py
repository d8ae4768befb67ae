"""The steps of a first start, said on stderr with what each should take here.

A model's first start may download, convert, export and time before its first token. Each such step says when it
starts what it does and how long it should take on this machine (its rate per GB of the model it works on, stored from
the last time it ran here with the other measurements, ``verispec.backends.measurements``), and when it ends what it
took; the new rate is stored for next time. The lines go through the package's logger (``verispec: ...`` on stderr),
one a step, so a log or CI shows them as well as a terminal; the steps' own progress bars (pip's, tqdm's) add detail
where there is a terminal.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from . import measurements

# The step's own clock (a test replaces it; patching time.perf_counter would reach every thread in the process).
_clock = time.perf_counter

log = logging.getLogger("verispec.steps")
RECORD = "step-rate"


def size_of(path: Path | str) -> int:
    """Bytes of a file, or of the files in a folder (the model a step works on)."""
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def _key(kind: str) -> dict:
    return {**measurements.machine(), "step": kind}


def expected_seconds(kind: str, size: int | None) -> float | None:
    """What step ``kind`` should take on ``size`` bytes here, from its last run on this machine; None: never timed."""
    if not size:
        return None
    known = measurements.load(RECORD, _key(kind))
    return None if known is None else known["s_per_gb"] * size / 1e9


@contextmanager
def step(what: str, kind: str, size: int | None = None) -> Iterator[None]:
    """Say ``what`` starts (with its expected duration when this machine ran ``kind`` before) and, when it ends, what
    it took; store the rate per GB of ``size``."""
    expected = expected_seconds(kind, size)
    amount = f" ({size / 1e9:.2f} GB)" if size else ""
    if expected is not None:
        log.warning("%s%s: about %s here, as it took last time ...", what, amount, _duration(expected))
    else:
        log.warning("%s%s: first time on this machine ...", what, amount)
    start = _clock()
    yield
    took = _clock() - start
    log.warning("%s: done in %s", what, _duration(took))
    if size:
        measurements.save(RECORD, _key(kind), {"s_per_gb": took / (size / 1e9), "size": size, "seconds": took})


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"
