"""Helpers of the in-process A/B scripts on a loaded model's passes (lookahead_ab.py, narrow_isa_ab.py): one model and
one cache, each setting applied in turn every round, passes of each width after the cached context, medians in ms of 3
passes a round (the first round dropped). Not run by itself."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def prefilled(model, context: int):
    """A new cache holding ``context`` tokens."""
    kv = model.new_kv()
    model.forward(kv, [(7 * i) % 1000 for i in range(context)], last_only=True)
    return kv


def same_logits(model, kv, context: int, settings: dict[str, Callable[[], None]], tokens: list[int]) -> bool:
    """Whether a pass over ``tokens`` gives the same logits under every setting."""
    logits = []
    for apply in settings.values():
        apply()
        logits.append(model.forward(kv, tokens).logits.clone())
        kv.truncate(context)
    return all(torch.equal(logits[0], other) for other in logits)


def time_settings(model, kv, context: int, settings: dict[str, Callable[[], None]], widths: list[int],
                  rounds: int) -> dict[tuple[str, int], float]:
    """{(setting, width): median ms a pass}, the settings taken in turn each round."""
    took: dict[tuple[str, int], list[float]] = {(s, w): [] for s in settings for w in widths}
    for r in range(rounds + 1):
        for name, apply in settings.items():
            apply()
            for w in widths:
                for _ in range(3):
                    start = time.perf_counter()
                    model.forward(kv, [(11 * i + r) % 1000 for i in range(w)])
                    kv.truncate(context)
                    if r:
                        took[(name, w)].append(1e3 * (time.perf_counter() - start))
    return {key: statistics.median(times) for key, times in took.items()}
