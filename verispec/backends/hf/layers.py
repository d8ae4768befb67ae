"""Views of a transformers model that run a subset of its decoder layers (self-speculative drafting)."""

from __future__ import annotations

import copy
from typing import Sequence

import torch

from ...errors import InvalidRequest


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layer list of a transformers causal LM (``model.model.layers`` in the families transformers
    ships: Llama, Qwen, Mistral, Gemma, Phi, ...)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise InvalidRequest(f"layer skipping needs a decoder whose layers are model.model.layers; "
                             f"{type(model).__name__} has none: use another drafter")
    return layers


def skipping_view(model: torch.nn.Module, skip: Sequence[int]) -> torch.nn.Module:
    """A shallow copy of ``model`` whose decoder runs only the layers not in ``skip``. Every module and weight is
    shared with ``model`` (nothing is copied, and ``model`` itself is unchanged); each kept layer still writes its own
    slot of a KV cache (its attention's layer index), so the view's caches leave the skipped slots empty. Layer 0 must
    be kept: the cache's length is read from its slot."""
    layers = decoder_layers(model)
    skip = set(skip)
    if 0 in skip or not skip <= set(range(len(layers))):
        raise InvalidRequest(f"cannot skip layers {sorted(skip)}: this model has layers 0-{len(layers) - 1}, and layer "
                             "0 is always kept")
    inner = copy.copy(model.model)
    inner._modules = dict(inner._modules)  # the copy's own module table: its layers are replaced, the model's are not
    inner.layers = torch.nn.ModuleList([layer for i, layer in enumerate(layers) if i not in skip])
    outer = copy.copy(model)
    outer._modules = dict(outer._modules)
    outer.model = inner
    return outer
