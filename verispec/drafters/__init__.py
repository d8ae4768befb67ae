"""Drafters: everything that proposes tokens for the target to verify.

Each drafter is one module that registers itself (``registry.register``); importing it here is what makes it known
to the command line, the server and bench method specs. See ``registry`` for how to add one.
"""

from __future__ import annotations

from .base import EMPTY_DRAFT, Draft, Drafter, DrafterBase
from .registry import NONE, DrafterSpec, Option, drafter_names, drafter_specs, get_spec, make_drafter, options_from
# each import registers a drafter, in the order the command line lists them
from .ngram import NgramDrafter  # noqa: E402  (isort: skip)
from .suffix import SuffixDrafter  # noqa: E402
from .model import ModelDrafter  # noqa: E402
from .eagle import EagleDrafter  # noqa: E402
from .layerskip import LayerSkipDrafter  # noqa: E402
from .lookahead import LookaheadDrafter  # noqa: E402
from .medusa import MedusaDrafter  # noqa: E402

__all__ = ["Draft", "Drafter", "DrafterBase", "DrafterSpec", "EMPTY_DRAFT", "EagleDrafter", "LayerSkipDrafter", "LookaheadDrafter", "MedusaDrafter", "ModelDrafter", "NONE",
           "NgramDrafter", "Option", "SuffixDrafter", "drafter_names", "drafter_specs", "get_spec", "make_drafter", "options_from"]
