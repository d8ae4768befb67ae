"""What this CPU can run: its model and instruction-set flags, and probes of special kernels before first use.

CPUs differ between machines of the same kind (an AVX-512 Xeon with bf16 dot products, an AVX2-only EPYC), and a
kernel that exists in the torch build may still refuse to run: oneDNN's packed bfloat16 linear needs AVX-512
(bw, vl, dq) or AVX-NE-CONVERT and raises a RuntimeError elsewhere. So nothing here trusts a flag list alone:
``packed_linear_works(dtype)`` runs the kernel once on a tiny tensor, compares it with ``F.linear`` and remembers
the answer for the process.
"""

from __future__ import annotations

import functools
import platform

import torch

# flags that decide which CPU kernels run fast (or at all); the rest of /proc/cpuinfo's list is noise here
ISA_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni",
             "avx512_bf16", "avx512_fp16", "avx_vnni", "avx_ne_convert", "amx_tile", "amx_bf16", "amx_int8",
             "asimd", "sve", "bf16")

PACK_BATCH_HINT = 16  # rows oneDNN tunes the blocked layout for; any row count works


@functools.cache
def cpu_info() -> dict:
    """{"model", "flags" (the ISA_FLAGS this CPU has), "torch_capability" (the vector ISA torch dispatches to)}."""
    model, flags = "", set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not model:
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):
        capability = "unknown"
    return {
        "model": model or platform.processor() or platform.machine(),
        "flags": [f for f in ISA_FLAGS if f in flags],
        "torch_capability": capability,
    }


def _packed_ops_exist() -> bool:
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


@functools.cache
def packed_linear_works(dtype: torch.dtype) -> bool:
    """Does oneDNN's prepacked linear run on this CPU for ``dtype``, and agree with ``F.linear``? Probed once per
    process on an 8x24 weight; any error (a missing kernel, an ISA the CPU lacks) means no."""
    if not _packed_ops_exist():
        return False
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(8, 24, generator=gen).to(dtype)
    x = torch.randn(3, 24, generator=gen).to(dtype)
    try:
        with torch.inference_mode():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
            y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
            ref = torch.nn.functional.linear(x, weight)
    except (RuntimeError, NotImplementedError, AttributeError):
        return False
    return y.shape == ref.shape and bool(torch.allclose(y.float(), ref.float(), rtol=1e-2, atol=1e-2))


def bfloat16_dot_products() -> bool:
    """Does this CPU multiply bfloat16 natively (AVX-512 BF16, AMX, Arm's BF16) and run oneDNN's packed bfloat16
    linear? Elsewhere bfloat16 matmuls are emulated through float32 and save little or nothing."""
    return bool(set(cpu_info()["flags"]) & {"avx512_bf16", "amx_bf16", "bf16"}) and packed_linear_works(torch.bfloat16)


def linear_kernel(dtype: torch.dtype, pack: bool = True) -> str:
    """A short name for the kernel a linear layer of this dtype runs on this CPU (for reports)."""
    if pack and packed_linear_works(dtype):
        return "oneDNN-packed"
    if dtype == torch.float32:
        plain = "F.linear (MKL)" if torch.backends.mkl.is_available() else "F.linear"
    else:
        plain = "F.linear (oneDNN)"
    return f"{plain}; this CPU cannot run the packed kernel" if pack and _packed_ops_exist() else plain
