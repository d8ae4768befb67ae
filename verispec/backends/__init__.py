"""Target backends: what runs the target model, behind one protocol (``base.TargetModel``).

    hf          transformers / PyTorch: float32 and bfloat16, token trees, hidden states, a compiled one-token step
    llamacpp    llama.cpp on GGUF files, as CPU users run them (pip install "verispec[llamacpp]")
    openvino    OpenVINO's CPU plugin on the model exported to OpenVINO IR (pip install "verispec[openvino]")
    blocks      verispec's native kernel (verispec.blockmm) on a GGUF file's own quantized blocks
    references  model references (built-in names, folders, .gguf files, hub ids) and the cache of converted models

Each backend registers itself (``registry.register(BackendSpec(...))``) from its module; importing it here is what
makes it known to ``load_model``, the command line, the server and bench. ``load_model`` picks the backend; nothing
above this package imports a backend module directly.
"""

from __future__ import annotations

import logging

from ..errors import ModelNotFound
from .base import DTYPES, KVCache, KVGroup, TargetModel, TargetModelBase, TargetPass, parse_dtype
from .references import BUILTINS, DEFAULT_MODEL, cache_dir
from .registry import AUTO, BackendSpec, backend_names, backend_specs, entry_options, get_backend, register
# each import registers a backend, in the order the command line lists them
from .hf import (COMPILE_ENV, COMPILE_MODES, COMPILED_VERIFY_ENV, PACK_ENV, LoadedModel, compile_mode,  # noqa: E402
                 default_compile_mode, pack_from_environment)
from . import llamacpp  # noqa: E402,F401
from .openvino import model as _openvino  # noqa: E402,F401
from . import blocks  # noqa: E402,F401

log = logging.getLogger(__name__)

def load_model(ref: str = DEFAULT_MODEL, backend: str = "transformers", **options) -> TargetModel:
    """Load a model reference (built-in name, local directory, .gguf file or hub id) on a registered backend.

    ``backend="auto"``: the fastest installed engine here that runs the model's own weights, estimated from the
    file or read from a stored timing (``verispec.backends.choice``). ``options`` are the backend's load options, declared with it (see
    ``verispec.backends.registry``; ``verispec models`` and ``--help`` list them); one another backend declares is
    refused unless it is unset (None or its default), so callers may pass the options of every backend at once.

    transformers (default): ``dtype`` (float32, bfloat16, float16), ``compiled`` (auto / on / off, or True / False:
    one-token steps and short verify passes compiled ahead of time, ``verispec.backends.hf.compiled``), ``threads``
    (torch's), ``device``, ``pack`` (prepacked oneDNN weights where this CPU runs them, ``.hf.packing``; default on
    unless VERISPEC_PACK=0). Returns a ``LoadedModel``.

    llamacpp: the GGUF file (a built-in name or a .gguf path) on llama.cpp; ``weights`` as they are or converted once
    (f32, f16, q8_0, ...; ``auto`` measures which is fastest here), ``threads`` (default: the cores this process may
    use), ``features`` (an eval callback for hidden states of earlier layers where the build lacks layer-input
    outputs), ``sequences`` (KV caches its context holds at once; a batch of N requests needs N).

    openvino: the model exported once to OpenVINO IR; ``weights`` as-is (a GGUF's own blocks), fp32, bf16, fp16,
    int8 or int4 (these two re-quantize: a changed model), ``threads``, ``min_width`` (2, the default: no one-token
    passes, so greedy speculation equals plain decoding by construction), ``static_widths`` (one-sequence passes
    padded to these widths run on static graphs; default auto, ``()`` none; ``verispec.backends.openvino.widths``)."""
    if backend == AUTO:
        from .choice import choose

        picked = choose(ref, load_model, options)
        log.info(picked.summary())
        backend = picked.backend
    spec = get_backend(backend)
    if not isinstance(ref, str) or not ref.strip():
        raise ModelNotFound("model reference is empty; pass a built-in name (e.g. smollm2-135m), a directory, "
                            "a .gguf file or a hub id")
    return spec.build(ref, **options)


__all__ = ["AUTO", "BUILTINS", "BackendSpec", "COMPILE_ENV", "COMPILE_MODES", "COMPILED_VERIFY_ENV", "DEFAULT_MODEL",
           "DTYPES", "KVCache", "KVGroup", "LoadedModel", "PACK_ENV", "TargetModel", "TargetModelBase", "TargetPass", "backend_names", "backend_specs", "cache_dir",
           "compile_mode", "default_compile_mode", "entry_options", "get_backend", "load_model", "pack_from_environment",
           "parse_dtype", "register"]
