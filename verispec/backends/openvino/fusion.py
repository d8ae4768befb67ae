"""One matmul for the projections that read the same input, in verispec's own exported graph.

A decoder layer of the llama family runs seven linear layers a token; three of them (``q_proj``, ``k_proj``,
``v_proj``) read the same normalized hidden state, and two more (``gate_proj``, ``up_proj``) read another. On a CPU
a narrow OpenVINO pass is bound by what each node costs, not by arithmetic (one inference thread instead of two
costs a 2-token int4 pass only 1.11x), so the export traces those groups as one linear layer over their stacked
weights, whose output is split again: five linear nodes a layer instead of seven. The rows of the stacked weight are
the rows of the original ones, so weight compression (NNCF quantizes each output row on its own, in groups along the
input) gives every row the same values, and the logits are those of the unfused graph (bitwise equal on the default
model in int4; docs/openvino.md).

This is done while tracing, without touching the modeling code: within ``fused_projections(model)`` the first module
of each group computes the stacked product and returns its own part, and the others return theirs from it. A module
called on another input than the first one's (a model family that projects differently) raises ``FusionError``, and
the export then traces the model as it is.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class FusionError(RuntimeError):
    """A fused projection was called on another input than its group's first one."""


class _Stacked(nn.Module):
    """Stands in for a group's first projection: one matmul over the group's stacked weights."""

    def __init__(self, linears: list[nn.Linear]) -> None:
        super().__init__()
        has_bias = linears[0].bias is not None
        self.linear = nn.Linear(linears[0].in_features, sum(lin.out_features for lin in linears), bias=has_bias)
        with torch.no_grad():
            self.linear.weight.copy_(torch.cat([lin.weight for lin in linears]))
            if has_bias:
                self.linear.bias.copy_(torch.cat([lin.bias for lin in linears]))
        self.sizes = [lin.out_features for lin in linears]
        self.input: torch.Tensor | None = None
        self.parts: tuple[torch.Tensor, ...] = ()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.input, self.parts = x, self.linear(x).split(self.sizes, dim=-1)
        return self.parts[0]


class _Part(nn.Module):
    """Stands in for a later projection of the group: its part of the stacked product."""

    def __init__(self, stacked: _Stacked, index: int, name: str) -> None:
        super().__init__()
        self.__dict__["stacked"] = stacked  # not a submodule: the weights belong to the first projection
        self.index, self.name = index, name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x is not self.stacked.input:
            raise FusionError(f"{self.name} was called on another input than its group's first projection")
        return self.stacked.parts[self.index]


def _groups(model: nn.Module) -> list[tuple[nn.Module, tuple[str, ...]]]:
    """Every (module, names) whose projections ``names`` are plain linear layers of one input width and dtype."""
    found = []
    for module in model.modules():
        for names in GROUPS:
            layers = [getattr(module, n, None) for n in names]
            if all(type(lin) is nn.Linear for lin in layers) and \
                    len({(lin.in_features, lin.weight.dtype, lin.bias is None) for lin in layers}) == 1:
                found.append((module, names))
    return found


@contextmanager
def fused_projections(model: nn.Module, allow=None):
    """Within the block, each group of projections of one input (``GROUPS``) runs as one linear layer (where
    ``allow(linears)`` says so, if given); yields how many groups were fused. The model's own modules are put back on
    the way out."""
    replaced = []
    try:
        for module, names in _groups(model):
            originals = [getattr(module, n) for n in names]
            if allow is not None and not allow(originals):
                continue
            stacked = _Stacked(originals)
            replaced.append((module, names, originals))
            setattr(module, names[0], stacked)
            for i, name in enumerate(names[1:], 1):
                setattr(module, name, _Part(stacked, i, name))
        yield len(replaced)
    finally:
        for module, names, originals in reversed(replaced):
            for name, original in zip(names, originals):
                setattr(module, name, original)
