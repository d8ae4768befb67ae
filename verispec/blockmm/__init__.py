"""Matrix products on a GGUF file's own quantized blocks, for decoding's skinny passes (1 to ~64 rows).

``matmul(x, blocks, kind)`` computes y = x W^T where W is held as the file holds it (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K,
Q5_K, Q6_K: ``formats``). The native kernel (``_native.cpp``, built from source when verispec is installed) unpacks each
weight block once per call and applies it to every row of x; activations are quantized per 32 values to int8 as
llama.cpp quantizes them, and the products are exact integers combined in float32 in one fixed order, so row i of y
is the same bits whatever else is in the pass (row-invariant: speculation and batching change no answer).
``reference.matmul`` is the same arithmetic in plain PyTorch.

The instruction set is chosen at run time: AVX-512 VNNI where the CPU has it, else AVX2 + FMA, else portable code
(correct, slow). ``available()`` says whether the kernel was built here, ``why_unavailable()`` why not.
"""

from __future__ import annotations

import os

import torch

from .formats import TYPES, BlockType, block_type

try:
    from . import _native
    _IMPORT_ERROR: str | None = None
except ImportError as e:  # not built (no compiler at install, or another platform)
    _native = None
    _IMPORT_ERROR = str(e)

THREADS_ENV = "VERISPEC_BLOCKMM_THREADS"


def available() -> bool:
    """Whether the native kernel is built and runs fast on this CPU (AVX2 or better)."""
    return _native is not None and _native.best_isa() != "scalar"


def why_unavailable() -> str | None:
    """None when ``available()``; else what is missing and how to get it."""
    if _native is None:
        return ("verispec's native block kernel is not built here (" + (_IMPORT_ERROR or "unknown") + "); it is "
                "compiled when verispec is installed: reinstall with a C++ compiler present "
                "(pip install --force-reinstall --no-deps -e .)")
    if _native.best_isa() == "scalar":
        return "this CPU has no AVX2: the native block kernel would run its slow portable code"
    return None


def isa() -> str:
    """The instruction set the kernel uses: avx512vnni, avx2 or scalar."""
    _require()
    return _native.isa()


def best_isa() -> str:
    _require()
    return _native.best_isa()


def set_isa(name: str) -> None:
    """Use another instruction set (``scalar``, ``avx2``, ``avx512vnni``; at most this CPU's best): for tests and
    measurements. The results are the same bits on every one."""
    _require()
    _native.set_isa(name)


_threads: int | None = None


def set_threads(threads: int | None) -> None:
    """The kernel's threads from now on in this process (None: ``default_threads``'s rule)."""
    global _threads
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    _threads = threads


def default_threads() -> int:
    """Threads: as set by ``set_threads``, else VERISPEC_BLOCKMM_THREADS, else the cores this process may use."""
    if _threads is not None:
        return _threads
    value = os.environ.get(THREADS_ENV)
    if value:
        return max(1, int(value))
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


def _require() -> None:
    if _native is None:
        raise RuntimeError(why_unavailable())


def matmul(x: torch.Tensor, blocks: torch.Tensor, kind: str | BlockType, threads: int | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """y [..., N] = x [..., K] W^T, W [N, K] held as GGUF blocks ``blocks`` (uint8 [N, bytes a row]) of type ``kind``.

    x is read as float32; y is float32."""
    _require()
    t = block_type(kind) if isinstance(kind, str) else kind
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or not blocks.is_contiguous():
        raise ValueError("blocks must be a contiguous uint8 tensor [rows, bytes a row]")
    K = x.shape[-1]
    N = blocks.shape[0]
    if blocks.shape[1] != t.row_bytes(K):
        raise ValueError(f"x has {K} columns but each {t.name} row of the weight holds "
                         f"{blocks.shape[1] // t.bytes * t.weights}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    if x2.dtype != torch.float32 or not x2.is_contiguous():
        x2 = x2.float().contiguous()
    M = x2.shape[0]
    y = out if out is not None else torch.empty(M, N, dtype=torch.float32)
    _native.matmul(t.ggml_id, x2.data_ptr(), blocks.data_ptr(), y.data_ptr(), M, N, K, blocks.shape[1],
                   threads or default_threads())
    return y.reshape(*lead, N)


__all__ = ["TYPES", "available", "best_isa", "block_type", "default_threads", "isa", "matmul", "set_isa", "set_threads",
           "why_unavailable"]
