"""Target backends: what runs the target model, behind one protocol (``base.TargetModel``).

    hf          transformers / PyTorch: float32 and bfloat16, token trees, hidden states, a compiled one-token step
    llamacpp    llama.cpp on GGUF files, as CPU users run them (pip install "verispec[llamacpp]")
    openvino    OpenVINO's CPU plugin on the model exported to OpenVINO IR (pip install "verispec[openvino]")
    references  model references (built-in names, folders, .gguf files, hub ids) and the cache of converted models

``load_model`` picks the backend; nothing above this package imports a backend module directly.
"""

from __future__ import annotations

import logging
import os

import torch

from ..errors import InvalidRequest, ModelNotFound
from .base import BACKENDS, DTYPES, KVCache, KVGroup, TargetModel, TargetPass, parse_dtype
from .llamacpp import WEIGHT_CHOICES as _LLAMACPP_WEIGHTS
from .openvino.export import WEIGHTS as _OPENVINO_WEIGHTS
from .references import BUILTINS, DEFAULT_MODEL, cache_dir

log = logging.getLogger(__name__)

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


# what --weights takes: llama.cpp's formats (as-is, auto, f32, f16, q8_0, ...) and OpenVINO's (fp32, int8, ...)
WEIGHT_CHOICES = (*_LLAMACPP_WEIGHTS, *(w for w in _OPENVINO_WEIGHTS if w not in _LLAMACPP_WEIGHTS))


def load_model(ref: str = DEFAULT_MODEL, dtype: str | torch.dtype = "float32", device: str | None = None,
               pack: bool | None = None, backend: str = "transformers", weights: str = "as-is",
               threads: int | None = None, features: bool = False, sequences: int | None = None,
               compiled: bool | str = False, min_width: int | None = None,
               static_widths: tuple[int, ...] | str | None = None) -> TargetModel:
    """Load a model reference (built-in name, local directory, .gguf file or hub id) on a backend.

    ``backend="auto"``: the fastest installed engine here that runs the model's own weights, timed once per model
    and CPU (``verispec.backends.choice``).

    ``backend="transformers"`` (default) returns a ``LoadedModel``. ``pack`` prepacks its linear layers' weights for
    oneDNN (see ``verispec.backends.hf.packing``) where this CPU runs the packed kernel for ``dtype`` (probed first;
    elsewhere the plain op stays): faster decoding, and float32 rows that do not depend on the pass width. By default
    it is on for float32 and bfloat16 on CPU unless VERISPEC_PACK=0.

    ``backend="llamacpp"`` returns a ``verispec.backends.llamacpp.LlamaCppModel`` over the GGUF file (a built-in name
    or a .gguf path), its weights as they are or converted once to ``weights`` (f32, f16, q8_0, ...; ``auto`` measures
    which is fastest here), run with ``threads`` threads (default: the cores this process may use); hidden states of
    any layer come from llama.cpp's layer-input outputs (for EAGLE heads; ``features=True`` installs an eval callback
    instead where the llama.cpp build or the model's architecture lacks them, which costs a little on every pass);
    ``sequences`` is how many KV caches its context holds at once (default 8; a batch of N requests needs N).

    ``compiled`` (transformers, float32, CPU): one-token decoding steps compiled ahead of time (see
    ``verispec.backends.hf.compiled``). ``"on"`` (or True) loads the step an earlier process stored for this model,
    dtype, CPU and software, or compiles and stores it now (about a minute for the default model on 2 cores);
    ``"auto"`` loads a stored one and otherwise stays eager, and is a no-op where the step does not apply (other
    dtypes, devices and backends); ``"off"`` (False, the default here; the command line's default is auto) is
    eager.

    ``min_width`` (openvino): passes of fewer tokens are padded to it; 2 (no one-token passes) makes every position's
    logits bitwise the same at every pass width, so greedy speculation equals plain decoding by construction; default
    2 in every weight format (see ``verispec.backends.openvino.model``). ``static_widths`` (openvino): a
    one-sequence pass of up to that many tokens is padded to the next of them and run on a graph of static shapes
    (default, or ``"auto"``: 1, 2, 4, 6 from ``min_width`` up, and 8 and 10 where they measure cheaper on this CPU,
    ``verispec.backends.openvino.widths``; ``()`` runs every pass on the dynamic graph)."""
    if backend == "auto":
        from .choice import choose

        picked = choose(ref, load_model, dtype, weights, compiled, threads)
        log.info(picked.summary())
        backend = picked.backend
    if backend not in BACKENDS:
        raise InvalidRequest(f"unknown backend {backend!r}; choose one of auto, {', '.join(BACKENDS)}")
    if min_width is not None and backend != "openvino":
        raise InvalidRequest("min_width applies to the openvino backend (its passes of one token are padded to two)")
    if static_widths is not None and backend != "openvino":
        raise InvalidRequest("static_widths applies to the openvino backend (its graphs of static shapes)")
    if not isinstance(ref, str) or not ref.strip():
        raise ModelNotFound("model reference is empty; pass a built-in name (e.g. smollm2-135m), a directory, "
                            "a .gguf file or a hub id")
    mode = compile_mode(compiled)
    if backend == "llamacpp":
        if parse_dtype(dtype) != torch.float32:
            raise InvalidRequest("dtype applies to the transformers backend; on llama.cpp choose the weight format "
                                 "with --weights (f32, f16, q8_0, ...)")
        if mode == "on":
            raise InvalidRequest("--compile applies to the transformers backend (llama.cpp's kernels are its own)")
        from .llamacpp import load

        return load(ref, weights, threads, features, sequences)
    if backend == "openvino":
        if parse_dtype(dtype) != torch.float32 or mode == "on":
            raise InvalidRequest("the openvino backend takes --weights as-is|fp32|bf16|fp16|int8|int4|auto (no --dtype or "
                                 "--compile; "
                                 "its hidden states need no flag)")
        from .openvino.model import load as load_openvino

        ov_weights = {"f32": "fp32", "f16": "fp16"}.get(weights, weights)
        if ov_weights not in (*_OPENVINO_WEIGHTS, "auto"):
            raise InvalidRequest(f"--weights {weights} is a llama.cpp format; the openvino backend takes "
                                 f"{', '.join(_OPENVINO_WEIGHTS)} or auto")
        return load_openvino(ref, ov_weights, threads, min_width=min_width, static_widths=static_widths)
    if weights != "as-is":
        raise InvalidRequest("--weights applies to the llamacpp backend; on transformers choose --dtype")
    from .hf import load

    return load(ref, dtype, device, pack, mode)


__all__ = ["BACKENDS", "BUILTINS", "COMPILE_ENV", "COMPILE_MODES", "DEFAULT_MODEL", "DTYPES", "WEIGHT_CHOICES", "KVCache", "KVGroup", "TargetModel", "TargetPass",
           "cache_dir", "load_model", "parse_dtype"]
