"""The transformers backend: ``load`` (a model reference to a ``LoadedModel``, ``.model``), its options and its
registration (``verispec.backends.registry``).

Its KV cache grows in place and rolls back through transformers' public Cache API (``.cache``); linear weights are
prepacked for oneDNN where this CPU runs that kernel (``verispec.backends.torch_cpu``); ``compiled`` compiles the
one-token step and short verify passes ahead of time (``.compiled``).
"""

from __future__ import annotations

import logging
import os

import torch

from ...errors import InvalidRequest, ModelNotFound
from ...options import Option
from ..base import DTYPES, parse_dtype
from ..registry import BackendSpec, register
from ..references import BUILTINS, float32_bytes, resolve, transformers_progress_bars
from .attention import use_grouped_sdpa
from .model import COMPILED_VERIFY_ENV, SWITCHED_OFF, LoadedModel  # noqa: F401 (COMPILED_VERIFY_ENV re-exported)
from .invariant import make_width_invariant
from ..torch_cpu.packing import pack_linear_layers

log = logging.getLogger(__name__)

PACK_ENV = "VERISPEC_PACK"  # 0 turns off prepacked oneDNN weights (verispec.backends.torch_cpu.packing)
INVARIANT_ENV = "VERISPEC_WIDTH_INVARIANT"  # 0 turns off width-invariant bfloat16 passes (verispec.backends.hf.invariant)

COMPILE_MODES = ("auto", "on", "off")  # --compile: a stored compiled step if any / compile now / eager


COMPILE_ENV = "VERISPEC_COMPILE"  # the command line's default --compile (auto unless set)


def default_compile_mode() -> str:
    """The command line's default ``--compile``: $VERISPEC_COMPILE (auto, on or off), else auto."""
    return compile_mode(os.environ.get(COMPILE_ENV, "").strip().lower() or "auto")


def compile_mode(compiled: bool | str) -> str:
    """``load_model``'s ``compiled`` as one of COMPILE_MODES (True is "on", False "off")."""
    mode = {True: "on", False: "off"}.get(compiled, compiled) if isinstance(compiled, bool) else compiled
    if mode not in COMPILE_MODES:
        raise InvalidRequest(f"compile takes {', '.join(COMPILE_MODES)} (or True / False), got {compiled!r}")
    return mode


def load(ref: str, dtype: str | torch.dtype = "float32", device: str | None = None, pack: bool | None = None,
         compiled: str = "off") -> LoadedModel:
    """Load a model reference (``verispec.backends.references``) with transformers; see ``verispec.load_model``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = parse_dtype(dtype)
    compiles = torch_dtype == torch.float32 and (device or "cpu") == "cpu"
    if compiled == "on" and not compiles:
        raise InvalidRequest(f"--compile is for float32 on CPU (what it was measured on), not {dtype} on "
                             f"{device or 'cpu'}; drop --compile or use --dtype float32")
    folder = resolve(ref)
    source = str(folder) if folder is not None else ref
    try:
        with transformers_progress_bars(folder is None):  # a hub id may download: show it; a local load is quiet
            tokenizer = AutoTokenizer.from_pretrained(source)
            model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype)
    except OSError as exc:
        if folder is None:
            raise ModelNotFound(
                f"could not load {ref!r} from the Hugging Face hub ({exc}). Without a network, use a local "
                f"directory, a .gguf file or a built-in name ({', '.join(BUILTINS)})"
            ) from exc
        raise ModelNotFound(f"could not load the model in {source}: {exc}") from exc
    if device:
        model = model.to(device)
    if pack is None:
        pack = pack_from_environment()
    packed = pack_linear_layers(model) if pack else 0
    invariant = invariant_from_environment() and make_width_invariant(model)
    if not invariant:
        use_grouped_sdpa(model)  # eager passes attend without copying each key/value head (.attention)
    loaded = LoadedModel(model=model, tokenizer=tokenizer, name=ref, dtype=torch_dtype, packed_layers=packed,
                         pack_requested=pack, width_invariant=invariant)
    if compiled == "on":
        loaded.compile_step()
    elif compiled == "auto" and compiles:
        loaded.compile_step(cached_only=True)
    log.info("%s in %s: linear layers run on %s", ref, dtype, loaded.linear_kernel)
    return loaded


def _switched_on(variable: str) -> bool:
    """An on-by-default switch: on unless the environment variable is 0/false/no/off."""
    return os.environ.get(variable, "1").strip().lower() not in SWITCHED_OFF


def invariant_from_environment() -> bool:
    """Width-invariant bfloat16 passes (``verispec.backends.hf.invariant``) are on unless VERISPEC_WIDTH_INVARIANT is
    0/false/no/off."""
    return _switched_on(INVARIANT_ENV)


def pack_from_environment() -> bool:
    """Packing is on unless VERISPEC_PACK is 0/false/no/off."""
    return _switched_on(PACK_ENV)


def _load(ref: str, dtype="float32", compiled="off", threads: int | None = None, device: str | None = None,
          pack: bool | None = None) -> LoadedModel:
    if threads is not None:
        if threads < 1:
            raise InvalidRequest(f"threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)  # torch's threads are the process's: every model it runs uses them
    return load(ref, dtype, device, pack, compile_mode(compiled))


register(BackendSpec(
    "transformers",
    summary="PyTorch on the model's values (a GGUF's dequantized once): every drafter, token trees, hidden states",
    load=_load,
    preference=0,
    cost=float32_bytes,  # computes with every weight in float32
    options=(
        Option("dtype", str, "float32", "weights and activations; float32 (default) guarantees greedy output "
               "identical to plain decoding, bfloat16 only approximately (rounding differs between wide and narrow "
               "passes)", choices=tuple(DTYPES)),
        Option("compiled", str, "off", "one-token decoding steps and verify passes of 2-12 tokens compiled ahead of "
               "time (AOTInductor; float32 on CPU; prefills, trees and wider passes stay eager). auto: use the "
               "compiled programs stored by an earlier process, else decode eagerly (a server with --max-batch 1 "
               "compiles them in the background and switches when ready); on: compile now if none is stored (a few "
               "minutes once per model and machine, then seconds to load; needs a C++ compiler); off: always eager. "
               f"The command line's default is auto, or ${COMPILE_ENV}. What it buys per CPU: docs/kernels.md",
               flag="compile", choices=COMPILE_MODES, metavar="auto|on|off", const="on", neutral=("auto",),
               cli_default=default_compile_mode),
        Option("threads", int, None, "torch's CPU threads in this process (default: torch's choice)"),
        Option("device", str, None, "torch device (default: cpu)", exposed=False),
        Option("pack", bool, None, "prepacked oneDNN weights (default: where this CPU runs them, unless "
               f"${PACK_ENV}=0)", exposed=False),
    ),
))
