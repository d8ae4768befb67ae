"""Prepacked oneDNN weights for the linear layers of a CPU model.

On CPU, ``torch.nn.functional.linear`` hands bfloat16 matmuls to oneDNN with the weight in its plain layout.
Packing the weight once into the blocked layout oneDNN's kernels want makes decoding's skinny matmuls (1 to ~25
rows against a big weight) faster: on this project's machine (AVX-512 bf16, no AMX, 2 threads) a one-token forward
of the default model took 33.6 ms packed against 39.8 ms unpacked, and a 16-token verify pass 41.1 against 51.4 ms
(``scripts/forward_cost.py --pack both``; README, "Prepacked bfloat16 weights"). The packed op gives bit-identical
results to ``F.linear`` in bfloat16 (tested), so it changes speed, never tokens.

``pack_linear_layers(model)`` swaps every ``nn.Linear`` of a bfloat16 CPU model for a ``PackedLinear`` that keeps
the original ``weight`` (shared with tied embeddings; the packed copy costs as much memory again) and calls
``torch.ops.mkldnn._linear_pointwise`` on the packed copy. It is a no-op where the op is missing (a torch build
without oneDNN) or the model is not bfloat16 on CPU.
"""

from __future__ import annotations

import torch
from torch import nn

PACK_BATCH_HINT = 16  # rows oneDNN tunes the blocked layout for; any row count works


def packing_available() -> bool:
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


class PackedLinear(nn.Module):
    """``nn.Linear`` with its weight packed once for oneDNN; calls that need gradients take the plain op."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = weight  # kept: tied embeddings, fingerprints and state dicts read it
        self.bias = bias
        with torch.no_grad():
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the packed copy is a snapshot: a model moved to another dtype or device, or a caller that needs
        # gradients, gets the plain op on the live weight
        stale = self.weight.dtype != self._packed.dtype or self.weight.device.type != "cpu"
        if stale or x.dtype != self.weight.dtype or (torch.is_grad_enabled() and x.requires_grad):
            return nn.functional.linear(x, self.weight, self.bias)
        bias = None if self.bias is None else self.bias.detach()
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=oneDNN"


def should_pack(model: nn.Module | torch.Tensor) -> bool:
    """Packing is for bfloat16 weights on CPU: there it is bit-identical to ``F.linear``. float32 is left alone
    (its matmuls go to MKL, and the packed op's float32 results differ from MKL's in the last bits)."""
    if isinstance(model, torch.Tensor):
        param = model
    else:
        try:
            param = next(model.parameters())
        except StopIteration:
            return False
    return param.device.type == "cpu" and param.dtype == torch.bfloat16 and packing_available()


def pack_linear_layers(model: nn.Module) -> int:
    """Replace the model's ``nn.Linear`` modules by ``PackedLinear`` in place; returns how many were packed."""
    if not should_pack(model):
        return 0
    targets = [(name, module) for name, module in model.named_modules() if type(module) is nn.Linear]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, PackedLinear(linear.weight, linear.bias))
    return len(targets)
