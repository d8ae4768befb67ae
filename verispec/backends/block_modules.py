"""The modules a model on GGUF blocks is made of (``verispec.backends.blocks`` swaps them in; the lean decoder layers
of ``verispec.backends.block_layers`` run on them): a linear layer over the file's own quantized rows and the
Llama / Qwen2 RMSNorm, each one call into ``verispec.blockmm``."""

from __future__ import annotations

import torch
from torch import nn

from .. import blockmm


class BlockLinear(nn.Module):
    """``nn.Linear`` on GGUF blocks: ``blocks`` uint8 [out_features, bytes a row] of type ``kind``."""

    def __init__(self, blocks: torch.Tensor, kind: str, in_features: int, bias: torch.Tensor | None = None):
        super().__init__()
        self.kind = blockmm.block_type(kind)
        self.in_features, self.out_features = in_features, blocks.shape[0]
        self.register_buffer("blocks", blocks.contiguous(), persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)
        self._matrix = blockmm.Matrix(self.blocks, self.kind, in_features)

    @property
    def weight(self) -> torch.Tensor:
        """The matrix's float32 values, dequantized on each access (by gguf, as transformers' loader does): for
        readers of an output layer such as EAGLE and Medusa heads; the forward pass never builds it."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        values = dequantize(self.blocks.numpy(), GGMLQuantizationType[self.kind.name])
        return torch.from_numpy(values.reshape(self.out_features, self.in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._matrix.blocks is not self.blocks:  # the buffer was replaced (``_apply``, a load): check it again
            self._matrix = blockmm.Matrix(self.blocks, self.kind, self.in_features)
        y = self._matrix(x)
        if self.bias is not None:
            y.add_(self.bias)
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kind.name} blocks"


class RowRMSNorm(nn.Module):
    """An RMSNorm of transformers' Llama / Qwen2 form (``weight * x / sqrt(mean(x ** 2) + eps)``) in one native call
    (``blockmm.rms_norm``) instead of six torch operations: ~60 norms a pass of the 1.5B."""

    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().float().contiguous(), requires_grad=False)
        self.eps = float(eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return blockmm.rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, native"
