"""The dtype a trained draft head (EAGLE, Medusa) runs in.

A head's tokens are only proposals: the target verifies every one (greedy: its argmax; sampling: strict rejection
sampling against the q the head really drew from), so the head's precision moves how many drafts are accepted,
never the output. What it does move is the drafter's own cost, which is what decides on small targets: a draft step
streams the head's layer and its vocabulary rows of the target's lm_head once per token. ``auto`` runs the head in
bfloat16 where that halves those bytes at no loss of speed (a CPU with native bfloat16 dot products under a float32
target) and in the target's dtype elsewhere. Measured in docs/eagle.md ("The head's precision").
"""

from __future__ import annotations

import torch

from ..backends.base import TargetModel
from ..errors import InvalidRequest

HEAD_DTYPES = ("auto", "float32", "bfloat16")


def head_dtype(choice: str, target: TargetModel) -> torch.dtype:
    """``choice`` (one of HEAD_DTYPES) resolved for a head that drafts for ``target`` in torch."""
    if choice not in HEAD_DTYPES:
        raise InvalidRequest(f"head precision must be one of {', '.join(HEAD_DTYPES)}, got {choice!r}")
    if choice != "auto":
        return {"float32": torch.float32, "bfloat16": torch.bfloat16}[choice]
    if target.dtype == torch.float32 and target.device.type == "cpu":
        from ..backends.torch_cpu.cpu import bfloat16_dot_products

        if bfloat16_dot_products():
            return torch.bfloat16
    return target.dtype
