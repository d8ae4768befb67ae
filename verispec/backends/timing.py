"""Timing a target's passes, for choosing a weight format by measurement (``--weights auto``) on any backend.

``auto_score`` turns a format's measured pass costs into estimated ms per generated token for speculation;
``time_widths`` measures them (passes of several widths after a cached context, and a prefill).
"""

from __future__ import annotations

import os
import statistics
import time

AUTO_ACCEPTANCE = 0.6  # per-token acceptance auto assumes for a drafter it has not seen (alpha, geometric model)
AUTO_WIDTHS = (1, 2, 5, 9)
# prompt tokens per generated token auto weighs prefill with (Spec-Bench's mean here: 291 prompt, 191 new tokens);
# prefill cost differs a lot by format (docs/llamacpp.md), so it is weighed too
AUTO_PROMPT_PER_OUTPUT = 1.5
AUTO_PREFILL = 256  # prompt tokens auto times a prefill with
AUTO_CONTEXT = 256  # cached positions when auto times the passes


def candidates_bar(candidates):
    """``candidates`` with a progress bar on a terminal (stderr): ``--weights auto`` loads, converts and times each
    format once per model and machine, half a minute or more on 2 cores, before the first token."""
    from tqdm.auto import tqdm

    return tqdm(candidates, desc="--weights auto: timing each format once on this CPU", unit="format", leave=False,
                disable=None)


def auto_score(ms: dict, alpha: float = AUTO_ACCEPTANCE, prompt_per_output: float = AUTO_PROMPT_PER_OUTPUT) -> float:
    """Estimated ms per generated token: decoding at the best measured width (a pass over n + 1 tokens, n drafts,
    commits E(n) = (1 - alpha^(n+1)) / (1 - alpha) tokens when each draft is accepted with probability alpha) plus
    the prefill of ``prompt_per_output`` prompt tokens (``ms["prefill"]`` per prompt token, when measured)."""
    decode = min(t / ((1 - alpha ** int(w)) / (1 - alpha)) for w, t in ms.items() if w.isdigit())
    return decode + prompt_per_output * ms.get("prefill", 0.0)


def default_threads() -> int:
    """Threads = the cores this process may use (every engine's default, and --backend auto's)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def read_bandwidth(threads: int, gigabytes: float = 1.0, rounds: int = 5) -> float:
    """Bytes a second this machine reads with ``threads`` threads: the fastest of ``rounds`` reads of a buffer of
    ``gigabytes`` (far larger than any cache) by two streaming kernels, a sum and a matrix-vector product (the BLAS
    library's, which requests its rows ahead and read faster than the sum on a Sapphire Rapids, where the block
    kernel's one-token passes had beaten the floor the sum alone gave: docs/kernels.md); torch's threads set for the
    measurement and restored after. Either rate is one this machine reaches, so the faster is the nearer bound."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        data = torch.ones(max(1, int(gigabytes * 2**30) // (4 * 4096)) * 4096, dtype=torch.float32)  # whole rows
        rows, vector = data.view(-1, 4096), torch.ones(4096)
        best = float("inf")
        for read in (data.sum, lambda: torch.mv(rows, vector)):
            read()
            for _ in range(rounds):
                t0 = time.perf_counter()
                read()
                best = min(best, time.perf_counter() - t0)
        return data.numel() * 4 / best
    finally:
        torch.set_num_threads(before)


def time_passes(model, context: int, widths, repeats: int) -> dict[int, float]:
    """Median ms of one pass over each width after ``context`` cached positions (any target backend); widths are
    interleaved within each round, the first round warms up and is dropped. A backend with graphs compiled per
    width (``prepare``, as a decoder's constructor calls it) has them compiled first, so passes are timed as
    decoders run them (OpenVINO: otherwise on its dynamic graph)."""
    if hasattr(model, "prepare"):
        model.prepare(width=max(widths))
    kv = model.new_kv()
    vocab = model.vocab_size
    model.forward(kv, [(7 * i) % vocab for i in range(context)], last_only=True)
    times: dict[int, list[float]] = {w: [] for w in widths}
    for r in range(repeats + 1):
        for w in widths:
            t0 = time.perf_counter()
            model.forward(kv, [(11 * i + r) % vocab for i in range(w)])
            kv.truncate(context)
            if r:
                times[w].append(1000 * (time.perf_counter() - t0))
    return {w: statistics.median(v) for w, v in times.items()}


def time_widths(model, widths=AUTO_WIDTHS, context: int = AUTO_CONTEXT, prefill: int = AUTO_PREFILL,
                repeats: int = 5) -> dict[str, float]:
    """Median ms of a pass over each width after ``context`` cached positions (keys: the widths as strings), and
    ms per prompt token of a ``prefill``-token prefill (key "prefill")."""
    timings = {str(w): ms for w, ms in time_passes(model, context, widths, repeats).items()}
    per_token = []
    for _ in range(3):
        kv = model.new_kv()
        t0 = time.perf_counter()
        model.forward(kv, [(13 * i) % model.vocab_size for i in range(prefill)], last_only=True)
        per_token.append(1000 * (time.perf_counter() - t0) / prefill)
        kv.close()
    timings["prefill"] = statistics.median(per_token)
    return timings
