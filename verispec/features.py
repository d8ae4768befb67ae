"""The target's hidden states at committed positions, kept beside its KV cache for drafters that read them
(EAGLE heads). They roll back with the cache: position i holds the target's hidden states at token i."""

from __future__ import annotations

import torch


class FeatureBuffer:
    """Rows [length, L, H] of target hidden states at the layers a drafter asked for, with amortised growth."""

    def __init__(self) -> None:
        self._data: torch.Tensor | None = None
        self.length = 0

    def __len__(self) -> int:
        return self.length

    def truncate(self, length: int) -> None:
        if length > self.length:
            raise ValueError(f"cannot truncate {self.length} feature rows to {length}")
        self.length = length

    def append(self, rows: torch.Tensor) -> None:
        need = self.length + rows.shape[0]
        if self._data is None or need > self._data.shape[0] or self._data.shape[1:] != rows.shape[1:]:
            capacity = max(need, 2 * (self._data.shape[0] if self._data is not None else 0), 256)
            data = rows.new_empty((capacity, *rows.shape[1:]))
            if self._data is not None and self.length:
                data[: self.length] = self._data[: self.length]
            self._data = data
        self._data[self.length : need] = rows
        self.length = need

    def view(self) -> torch.Tensor:
        """The rows as a tensor view (valid until the next append)."""
        if self._data is None:
            raise ValueError("no features recorded yet")
        return self._data[: self.length]


def select_layers(hidden_states: tuple[torch.Tensor, ...], layers: tuple[int, ...]) -> torch.Tensor:
    """[n, L, H] from transformers' ``hidden_states`` tuple (each [1, n, H]) at the given indices."""
    return torch.stack([hidden_states[i][0] for i in layers], dim=1)
