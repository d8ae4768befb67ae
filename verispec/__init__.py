"""verispec: lossless speculative decoding for Hugging Face causal language models."""

from .backends import BUILTINS, DEFAULT_MODEL, load_model
from .backends import LoadedModel
from .drafters import (Draft, Drafter, DrafterBase, DrafterSpec, EagleDrafter, ModelDrafter, NgramDrafter, Option,
                       drafter_names, make_drafter)
from .drafters.registry import register as register_drafter
from .engine import Generation, GenerationStream, SpeculativeDecoder
from .errors import IncompatibleDrafter, InvalidRequest, ModelNotFound, VerispecError
from .sampling import SamplingParams, probabilities
from .stats import GenerationStats
from .verify import Verdict, verify, verify_typical
from .version import __version__

__all__ = [
    "BUILTINS", "DEFAULT_MODEL", "Draft", "Drafter", "DrafterBase", "DrafterSpec", "EagleDrafter", "Generation",
    "GenerationStats", "GenerationStream", "IncompatibleDrafter", "InvalidRequest", "LoadedModel", "ModelDrafter",
    "ModelNotFound", "NgramDrafter", "Option", "SamplingParams", "SpeculativeDecoder", "Verdict", "VerispecError",
    "__version__", "drafter_names", "load_model", "make_drafter", "probabilities", "register_drafter", "verify",
    "verify_typical",
]
