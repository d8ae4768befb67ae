"""The modules a model on GGUF blocks is made of (``verispec.backends.blocks`` swaps them in; the lean decoder layers
of ``verispec.backends.block_layers`` run on them): a linear layer over the file's own quantized rows and the
Llama / Qwen2 RMSNorm, each one call into ``verispec.blockmm``."""

from __future__ import annotations

import threading

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
        self.packed = False  # the file's row layout, or the 16-row one (``pack``)
        self._matrix = blockmm.Matrix(self.blocks, self.kind, in_features)

    def pack(self) -> None:
        """Lay the blocks out 16 rows at a time, in place (``blockmm.pack16``: the 16-row tiles read it at every width
        without transposing; AVX-512 VNNI CPUs, K types, a multiple of 16 rows). The products keep their bits."""
        if not self.packed:
            blockmm.pack16(self.blocks, self.kind)
            self.packed = True
            self._matrix = blockmm.Matrix(self.blocks, self.kind, self.in_features, packed=True)

    @property
    def weight(self) -> torch.Tensor:
        """The matrix's float32 values, dequantized on each access (by gguf, as transformers' loader does): for
        readers of an output layer such as EAGLE and Medusa heads; the forward pass never builds it."""
        blocks = self.blocks
        if self.packed:
            blocks = blocks.clone()
            blockmm.pack16(blocks, self.kind, unpack=True)
        return _dequantized(blocks, self.kind, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._matrix.blocks is not self.blocks:  # the buffer was replaced (``_apply``, a load): check it again
            self._matrix = blockmm.Matrix(self.blocks, self.kind, self.in_features, packed=self.packed)
        y = self._matrix(x)
        if self.bias is not None:
            y.add_(self.bias)
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def extra_repr(self) -> str:
        layout = ", 16-row layout" if self.packed else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kind.name} blocks{layout}"


def _dequantized(blocks: torch.Tensor, kind, columns: int) -> torch.Tensor:
    """Rows of GGUF blocks as float32 [rows, columns], dequantized by gguf (as transformers' loader does). A few rows
    go to the type's ``dequantize_rows`` directly: gguf's ``dequantize`` runs it over groups of 16 rows (bounding its
    temporaries on a whole table), each value computed alone, so the same bits with less of its overhead."""
    from gguf import GGMLQuantizationType, quants

    if blocks.shape[0] <= 16:
        rows = getattr(quants, kind.name)
        rows.init_grid()
        values = rows.dequantize_rows(blocks.numpy())
    else:
        values = quants.dequantize(blocks.numpy(), GGMLQuantizationType[kind.name])
    return torch.from_numpy(values.reshape(blocks.shape[0], columns))


ROW_CACHE_BYTES = 32 << 20  # a BlockEmbedding's dequantized rows kept for the next passes


class BlockEmbedding(nn.Module):
    """A token embedding held as the file's blocks: each pass dequantizes only the rows its tokens pick (the 1.5B's
    table is 0.9 GB in float32, 0.16 GB as Q4_K). ``embedding`` is the model's own module (``nn.Embedding`` or a
    subclass, such as Gemma's scaled one); it computes each pass on those rows alone, so the output is its own."""

    def __init__(self, embedding: nn.Embedding, blocks: torch.Tensor, kind: str):
        super().__init__()
        self.kind = blockmm.block_type(kind)
        self.num_embeddings, self.embedding_dim = blocks.shape[0], embedding.embedding_dim
        self.register_buffer("blocks", blocks.contiguous(), persistent=False)
        self.inner = embedding
        self.inner.weight = None  # never the whole table: each pass sets the rows it reads
        self.inner.padding_idx = None  # an index into the whole table (it only stops gradients)
        # rows dequantized before, by token, the oldest dropped past ROW_CACHE_BYTES: gguf's numpy dequantization
        # was a visible share of a small model's one-token pass (docs/kernels.md); the same bits either way
        self._rows: dict[int, torch.Tensor] = {}
        self._most = max(1, ROW_CACHE_BYTES // (4 * self.embedding_dim))
        self._lock = threading.Lock()

    @property
    def weight(self) -> torch.Tensor:
        """The whole table in float32, dequantized on each access (for readers such as EAGLE heads)."""
        return _dequantized(self.blocks, self.kind, self.embedding_dim)

    def rows(self, tokens: list[int]) -> torch.Tensor:
        """The table's rows for ``tokens`` (distinct), float32 [len(tokens), embedding_dim]."""
        with self._lock:
            kept = self._rows
            missing = [t for t in tokens if t not in kept]
            if missing:
                values = _dequantized(self.blocks[missing], self.kind, self.embedding_dim)
                kept.update(zip(missing, values))
                while len(kept) > max(self._most, len(tokens)):
                    del kept[next(iter(kept))]
            return torch.stack([kept[t] for t in tokens])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.numel() == 1:
            picked, where = ids.reshape(1), torch.zeros_like(ids)
        else:
            picked, where = torch.unique(ids, return_inverse=True)
        rows = self.rows(picked.tolist())
        if type(self.inner) is nn.Embedding:  # its forward is this lookup (no scaling, no norm)
            return rows[where]
        self.inner.weight = nn.Parameter(rows, requires_grad=False)
        try:
            return self.inner(where)
        finally:
            self.inner.weight = None

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.kind.name} blocks"


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
