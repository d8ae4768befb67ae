"""The arithmetic floor of a blocks pass: its products timed with their weights in cache (``verispec costs``).

A one-token pass streams the model's bytes from memory once, so the read bandwidth bounds it (the memory floor that
``verispec costs`` prints). A pass of many tokens applies each weight to every row, so the kernel's arithmetic bounds
it instead. This times the products a pass of w tokens runs, each on a leading slice of its matrix small enough to
stay in the last-level cache (whole 16-row groups, in the layout the pass reads), scaled to the whole matrix: what the
pass's products would cost were memory free. Where that sum is close to the measured pass, arithmetic binds; where the
memory floor is, memory does. Attention, norms and the rest of the step are not in it.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from .. import blockmm

CACHE_SLICE_BYTES = 4 << 20  # a product's slice of weights: well inside the last-level caches seen (32 MB and up)


@contextmanager
def _recording(calls: list):
    """Every ``blockmm.Matrix`` product made in Python meanwhile, as (matrix, rows)."""
    original = blockmm.Matrix.__call__

    def recorded(matrix, x):
        calls.append((matrix, x.numel() // matrix.K))
        return original(matrix, x)

    blockmm.Matrix.__call__ = recorded
    try:
        yield calls
    finally:
        blockmm.Matrix.__call__ = original


def pass_products(model, width: int, context: int = 0) -> list[tuple[blockmm.Matrix, int]]:
    """The products one pass of ``width`` tokens after ``context`` cached ones runs on blocks model ``model``, as
    (matrix, rows): those made in Python (the output head; every layer's where no native stack serves the pass) and
    the native stack's."""
    kv = model.new_kv()
    vocab = model.vocab_size
    if context:
        model.forward(kv, [(7 * i) % vocab for i in range(context)], last_only=True)
    stack = model.stack
    served = stack.passes if stack is not None else 0
    with _recording([]) as calls:
        model.forward(kv, [(11 * i) % vocab for i in range(width)])
    kv.close()
    if stack is not None and stack.passes > served:
        calls += [(matrix, width) for matrix in stack._matrices]
    return calls


def _slice(matrix: blockmm.Matrix) -> blockmm.Matrix:
    """A leading slice of ``matrix``'s rows (whole 16-row groups, its layout) of at most CACHE_SLICE_BYTES."""
    row_bytes = matrix.blocks.shape[1]
    rows = min(matrix.N, max(16, CACHE_SLICE_BYTES // row_bytes // 16 * 16))
    return blockmm.Matrix(matrix.blocks[:rows], matrix.type, matrix.K, packed=matrix.packed)


def _time_product(matrix: blockmm.Matrix, rows: int, seconds: float) -> float:
    """Best seconds of one product of ``rows`` rows by ``matrix`` (its weights in cache after the first call)."""
    x = torch.randn(rows, matrix.K)
    matrix(x)
    best, spent, calls = float("inf"), 0.0, 0
    while spent < seconds or calls < 3:
        t0 = time.perf_counter()
        matrix(x)
        dt = time.perf_counter() - t0
        best, spent, calls = min(best, dt), spent + dt, calls + 1
    return best


def products_in_cache(model, widths, context: int = 0, seconds: float = 0.05,
                      rounds: int = 3) -> dict[int, dict[str, float]]:
    """ms of each width's pass products with their weights in cache (see the module), in all ("all") and by block
    type: each distinct product shape timed on its slice, the best of ``rounds`` rounds (every shape and width once a
    round, so that a slow phase of a shared machine hits them all) of ``seconds`` of calls, scaled by the matrix's rows
    over the slice's and counted as often as the pass runs it."""
    shapes: dict[tuple, list] = {}  # (type, N, K, layout, rows) -> [slice, rows of the whole matrix, {width: count}]
    for width in widths:
        for matrix, rows in pass_products(model, width, context):
            key = (matrix.type.name, matrix.N, matrix.K, matrix.packed, rows)
            if key not in shapes:
                shapes[key] = [_slice(matrix), matrix.N, {}]
            counts = shapes[key][2]
            counts[width] = counts.get(width, 0) + 1
    best: dict[tuple, float] = {}
    with blockmm.threads_held():
        _time_product(next(iter(shapes.values()))[0], 1, 10 * seconds)  # threads and clocks awake first
        for _ in range(rounds):
            for key, (part, _, _) in shapes.items():
                best[key] = min(best.get(key, float("inf")), _time_product(part, key[4], seconds))
    out: dict[int, dict[str, float]] = {}
    for width in widths:
        by_type: dict[str, float] = {}
        for key, (part, n, counts) in shapes.items():
            if width in counts:
                by_type[key[0]] = by_type.get(key[0], 0.0) + best[key] * n / part.N * counts[width] * 1e3
        out[width] = {"all": sum(by_type.values()), **dict(sorted(by_type.items()))}
    return out
