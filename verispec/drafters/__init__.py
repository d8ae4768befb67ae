"""Drafters: everything that proposes tokens for the target to verify."""

from __future__ import annotations

from ..errors import InvalidRequest
from .base import EMPTY_DRAFT, Draft, Drafter
from .model import ModelDrafter
from .ngram import NgramDrafter

DRAFTERS = ("none", "ngram", "model")


def make_drafter(name: str, target=None, draft_model=None, **options) -> Drafter | None:
    """Build a drafter by name. ``draft_model`` (a LoadedModel) is required for ``model``."""
    if name == "none":
        return None
    if name == "ngram":
        return NgramDrafter(**options)
    if name == "model":
        if draft_model is None:
            raise InvalidRequest("the model drafter needs a draft model: pass --draft-model REF (a smaller model "
                                 "with the target's tokenizer)")
        return ModelDrafter(draft_model, target, **options)
    raise InvalidRequest(f"unknown drafter {name!r}; choose one of {', '.join(DRAFTERS)}")


__all__ = ["Draft", "Drafter", "EMPTY_DRAFT", "ModelDrafter", "NgramDrafter", "DRAFTERS", "make_drafter"]
