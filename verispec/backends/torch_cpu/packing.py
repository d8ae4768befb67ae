"""Prepacked oneDNN weights for the linear layers of a CPU model, where this CPU can run them.

On CPU, ``torch.nn.functional.linear`` hands matmuls to MKL (float32) or oneDNN (bfloat16) with the weight in its
plain layout. Packing the weight once into the blocked layout oneDNN's kernels want makes decoding's skinny matmuls
(1 to ~64 rows against a big weight) faster, in float32 on AVX2 CPUs and in bfloat16 on AVX-512 ones (figures per CPU: docs/kernels.md).
The packed bfloat16 kernel needs AVX-512 (bw/vl/dq) or AVX-NE-CONVERT; ``verispec.backends.torch_cpu.cpu.packed_linear_works`` probes
it before any layer is packed, so a CPU without it keeps the plain op (slower, never a crash).

Numbers: in bfloat16 the packed op equals ``F.linear`` bit for bit. In float32 it differs from MKL in the last bits
(~1e-6 relative); its rows do not depend on how many rows are in the pass (MKL's change between 16 and 17 rows),
but attention still rounds differently per pass width, so a model's logits differ between a one-token step and a
wide pass by ~5e-7 packed or not (tests/test_packing.py measures both).

``pack_linear_layers(model)`` swaps every ``nn.Linear`` of a float32 or bfloat16 CPU model for a ``PackedLinear``
that keeps the original ``weight`` (shared with tied embeddings; the packed copy costs as much memory again).
"""

from __future__ import annotations

import torch
from torch import nn

from .cpu import PACK_BATCH_HINT, packed_linear_works

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


def packing_available(dtype: torch.dtype) -> bool:
    """Can linear layers of ``dtype`` be packed on this CPU (probed once per process)?"""
    return dtype in PACKABLE_DTYPES and packed_linear_works(dtype)


class PackedLinear(nn.Module):
    """``nn.Linear`` with its weight packed once for oneDNN; calls that need gradients take the plain op."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = weight  # kept: tied embeddings, fingerprints and state dicts read it
        self.bias = bias
        with torch.no_grad():
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)
        # one row computed as two copies of it: oneDNN's one-row path can round a row otherwise than a product of
        # several rows does (``verispec.backends.hf.invariant``); off unless a model asks for width-invariant passes
        self.one_row_as_two = False
        # the widest product run at once: oneDNN switches to another kernel for wider ones (bfloat16 on Sapphire
        # Rapids: past 32 rows, AMX tiles), which rounds a row otherwise; wider passes then run as products of at most
        # this many rows. None (off) unless a model asks for width-invariant passes
        self.rows_at_once: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the packed copy is a snapshot: a model moved to another dtype or device, or a caller that needs
        # gradients, gets the plain op on the live weight
        stale = self.weight.dtype != self._packed.dtype or self.weight.device.type != "cpu"
        if stale or x.dtype != self.weight.dtype or (torch.is_grad_enabled() and x.requires_grad):
            return nn.functional.linear(x, self.weight, self.bias)
        bias = None if self.bias is None else self.bias.detach()
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if self.rows_at_once and rows > self.rows_at_once:
            flat = x.reshape(rows, x.shape[-1])
            parts = [self._product(flat[i : i + self.rows_at_once], bias) for i in range(0, rows, self.rows_at_once)]
            return torch.cat(parts).reshape(*x.shape[:-1], self.out_features)
        return self._product(x, bias)

    def _product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.one_row_as_two and x.numel() == x.shape[-1]:
            twice = torch.cat([x, x], dim=-2) if x.dim() >= 2 else torch.stack([x, x])
            out = torch.ops.mkldnn._linear_pointwise(twice, self._packed, bias, "none", [], "")
            return out[..., :1, :] if x.dim() >= 2 else out[0]
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=oneDNN"


def should_pack(model: nn.Module | torch.Tensor) -> bool:
    """Packing is for float32 and bfloat16 weights on a CPU whose oneDNN runs the packed kernel for that dtype."""
    if isinstance(model, torch.Tensor):
        param = model
    else:
        try:
            param = next(model.parameters())
        except StopIteration:
            return False
    return param.device.type == "cpu" and packing_available(param.dtype)


def pack_linear_layers(model: nn.Module) -> int:
    """Replace the model's ``nn.Linear`` modules by ``PackedLinear`` in place; returns how many were packed
    (0 where this CPU or dtype cannot use the packed kernel)."""
    if not should_pack(model):
        return 0
    targets = [(name, module) for name, module in model.named_modules() if type(module) is nn.Linear]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, PackedLinear(linear.weight, linear.bias))
    return len(targets)
