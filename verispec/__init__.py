"""verispec: lossless speculative decoding for Hugging Face causal language models."""

from .drafters import Draft, Drafter, EagleDrafter, ModelDrafter, NgramDrafter, make_drafter
from .engine import Generation, GenerationStream, SpeculativeDecoder
from .errors import IncompatibleDrafter, InvalidRequest, ModelNotFound, VerispecError
from .backends import BUILTINS, DEFAULT_MODEL, load_model
from .backends.hf import LoadedModel
from .sampling import SamplingParams, probabilities
from .stats import GenerationStats
from .verify import Verdict, verify, verify_typical

from .version import __version__

__all__ = [
    "BUILTINS", "DEFAULT_MODEL", "Draft", "Drafter", "EagleDrafter", "Generation", "GenerationStats", "GenerationStream",
    "IncompatibleDrafter", "InvalidRequest", "LoadedModel", "ModelDrafter", "ModelNotFound", "NgramDrafter",
    "SamplingParams", "SpeculativeDecoder", "Verdict", "VerispecError", "load_model", "make_drafter",
    "probabilities", "verify", "verify_typical",
]
