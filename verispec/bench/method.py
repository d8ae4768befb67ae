"""What a benchmark method is (a name and a function that answers one prompt) and what one answer records."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass
class Run:
    """What one method did on one prompt; raw numbers only."""

    token_ids: list[int]
    wall_seconds: float
    step_tokens: list[int]  # tokens committed by each target step (accepted drafts + 1)
    step_seconds: list[float]  # wall time of each step; the first one includes the prefill
    finish_reason: str = ""
    lossy: bool = False
    step_drafted: list[int] | None = None  # None: the method does not report its drafts
    step_accepted: list[int] | None = None
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    draft_seconds: float | None = None  # time spent proposing, when the method reports it


@dataclass
class Method:
    name: str
    run: Callable[..., Run]  # run(prompt_ids, max_new_tokens, temperature, top_p, seed) -> Run
    family: str  # "verispec" or "transformers"
    drafter: str = "none"
    k: int | None = None
    kernel: str = ""  # what ran the target's layers, when known (backend, weights, kernel)
    close: Callable[[], None] | None = None  # releases what the method holds (a server process), when anything
    target: object | None = None  # the TargetModel a verispec method runs (its quality is measured on it)
    changed_model: str = ""  # why the weights it runs are not the model's own (a re-quantization), else ""
