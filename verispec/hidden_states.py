"""The target's hidden states at committed positions, kept beside its KV cache for drafters that read them
(EAGLE and Medusa heads). They roll back with the cache: position i holds the target's hidden states at token i.
A prompt's first positions may have none (``skip``): on llama.cpp a row's hidden state costs its logits too, so a
drafter that reads only the last rows of a prompt (``prompt_feature_rows``) has the rest prefilled without them."""

from __future__ import annotations

import torch


class FeatureBuffer:
    """Rows [length, L, H] of target hidden states at the layers a drafter asked for, with amortised growth.
    Positions ``start``..``length - 1`` have them; the positions before ``start`` were skipped."""

    def __init__(self) -> None:
        self._data: torch.Tensor | None = None
        self.length = 0
        self.start = 0

    def __len__(self) -> int:
        return self.length

    def truncate(self, length: int) -> None:
        if length > self.length:
            raise ValueError(f"cannot truncate {self.length} feature rows to {length}")
        self.length = length
        self.start = min(self.start, length)

    def skip(self, n: int) -> None:
        """``n`` positions that get no hidden states; rows recorded before them are dropped from ``view`` too, so
        the rows a drafter sees are always the last positions', without a gap."""
        if n > 0:
            self.length += n
            self.start = self.length

    def extend_from(self, other: "FeatureBuffer", length: int) -> None:
        """Take ``other``'s first ``length`` positions (an empty buffer joining a cached prompt prefix)."""
        if self.length:
            raise ValueError("extend_from needs an empty feature buffer")
        first = min(other.start, length)
        self.skip(first)
        if length > first:
            self.append(other._data[first:length])  # append copies into this buffer's own storage

    def append(self, rows: torch.Tensor) -> None:
        need = self.length + rows.shape[0]
        if self._data is None or need > self._data.shape[0] or self._data.shape[1:] != rows.shape[1:]:
            capacity = max(need, 2 * (self._data.shape[0] if self._data is not None else 0), 256)
            data = rows.new_empty((capacity, *rows.shape[1:]))
            if self._data is not None and self.length > self.start:
                data[self.start : self.length] = self._data[self.start : self.length]
            self._data = data
        self._data[self.length : need] = rows
        self.length = need

    def view(self) -> torch.Tensor:
        """The rows of positions ``start``..``length - 1`` as a tensor view (valid until the next append): row -1 is
        the last position's."""
        if self._data is None:
            raise ValueError("no features recorded yet")
        return self._data[self.start : self.length]


def select_layers(hidden_states: tuple[torch.Tensor, ...], layers: tuple[int, ...]) -> torch.Tensor:
    """[n, L, H] from transformers' ``hidden_states`` tuple (each [1, n, H]) at the given indices."""
    return torch.stack([hidden_states[i][0] for i in layers], dim=1)
