"""Drafters: everything that proposes tokens for the target to verify."""

from __future__ import annotations

from ..errors import InvalidRequest
from .base import EMPTY_DRAFT, Draft, Drafter
from .eagle import EagleDrafter
from .model import ModelDrafter
from .ngram import NgramDrafter

DRAFTERS = ("none", "ngram", "model", "eagle")


def make_drafter(name: str, target=None, draft_model=None, **options) -> Drafter | None:
    """Build a drafter by name. ``draft_model`` (a LoadedModel) is required for ``model``; ``eagle`` takes
    ``head`` (a folder written by ``verispec train-eagle``; default: the head shipped for a built-in target)."""
    if name == "none":
        return None
    if name == "ngram":
        return NgramDrafter(**options)
    if name == "model":
        if draft_model is None:
            raise InvalidRequest("the model drafter needs a draft model: pass --draft-model REF (a smaller model "
                                 "with the target's tokenizer)")
        return ModelDrafter(draft_model, target, **options)
    if name == "eagle":
        if target is None:
            raise InvalidRequest("the eagle drafter needs the target model it drafts for")
        return EagleDrafter(target, **options)
    raise InvalidRequest(f"unknown drafter {name!r}; choose one of {', '.join(DRAFTERS)}")


__all__ = ["Draft", "EagleDrafter", "Drafter", "EMPTY_DRAFT", "ModelDrafter", "NgramDrafter", "DRAFTERS", "make_drafter"]
