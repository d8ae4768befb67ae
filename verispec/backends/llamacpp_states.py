"""How a llama.cpp pass gives back hidden states other than the final one (``verispec.backends.llamacpp``).

``LayerInputs``: llama.cpp's own layer-input outputs (no callback), where the build and the model's architecture
have them. ``FeatureTap``: the eval callback that copies named tensors out of a pass as it computes them, a Python
call per graph node on every pass; the fallback elsewhere. The final normed state comes from llama.cpp's embeddings
output in the backend itself.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np
import torch

from ..errors import InvalidRequest


class GgmlTensor(ctypes.Structure):
    """The head of ggml's ``struct ggml_tensor`` (ggml.h: GGML_MAX_DIMS 4, GGML_MAX_OP_PARAMS 64, GGML_MAX_SRC 10,
    GGML_MAX_NAME 64), enough to read a computed tensor's name, shape, type and host data in the eval callback."""

    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16),
                ("flags", ctypes.c_int32), ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p),
                ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64)]


class FeatureTap:
    """The eval callback that copies named hidden states out of a ``llama_decode`` as it computes them.

    transformers' ``hidden_states[i]`` is llama.cpp's ``embd`` (the looked-up embeddings) for i = 0, the output of
    layer i - 1 (``l_out-{i-1}``) for 0 < i < n_layer, and the final norm's output (``result_norm``) for i = n_layer; the last
    layer computes only the rows whose logits are asked for, so asking for hidden_states[n_layer] means asking for
    logits of every row."""

    def __init__(self, n_layer: int) -> None:
        self.n_layer = n_layer
        self.wanted: dict[bytes, list[torch.Tensor]] = {}
        self.callback = None  # the ctypes function object, kept alive with the context

    def name(self, layer: int) -> bytes:
        if not 0 <= layer <= self.n_layer:
            raise InvalidRequest(f"hidden-state layer {layer} is outside 0..{self.n_layer}")
        return b"embd" if layer == 0 else b"result_norm" if layer == self.n_layer else b"l_out-%d" % (layer - 1)

    def __call__(self, tensor_ptr, ask: bool, user_data) -> bool:
        if not self.wanted:  # nothing asked for: let the graph run through
            return not ask
        t = ctypes.cast(tensor_ptr, ctypes.POINTER(GgmlTensor)).contents
        name = t.name
        if name not in self.wanted:
            return not ask
        if ask:
            return True
        cols, rows = int(t.ne[0]), int(t.ne[1])
        if t.type != 0 or t.nb[0] != 4 or t.nb[1] != 4 * cols or not t.data:  # GGML_TYPE_F32, contiguous, on host
            raise RuntimeError(f"cannot read llama.cpp tensor {name!r}: not a contiguous float32 tensor in host memory")
        values = np.ctypeslib.as_array((ctypes.c_float * (rows * cols)).from_address(t.data))
        self.wanted[name].append(torch.from_numpy(values.reshape(rows, cols).copy()))
        return True


class LayerInputs:
    """llama.cpp's own hidden-state outputs: ``llama_set_embeddings_layer_inp(ctx, layer, on)`` makes a pass keep
    the input of decoder layer ``layer`` (transformers' ``hidden_states[layer]``) for every row, and
    ``llama_get_embeddings_layer_inp`` returns it; no eval callback, no Python per graph node. The two functions
    are in llama.cpp's extension header (for its EAGLE-3 and DFlash drafters) with C++ linkage, so they are found
    by their mangled names; builds without them fall back to the callback (``features=True``)."""

    # the architectures whose graphs record their layer inputs, tried here (llama-cpp-python 0.3.36, one zoo family
    # each in a child process): asking any other for them aborts the process in a GGML_ASSERT (qwen2, gemma3 and
    # phi3 did), so they keep the callback
    ARCHITECTURES = frozenset({"llama", "qwen3"})
    SET = "_Z30llama_set_embeddings_layer_inpP13llama_contextjb"
    GET = "_Z30llama_get_embeddings_layer_inpP13llama_contextj"

    def __init__(self, setter, getter, n_embd: int) -> None:
        self._set, self._get, self.n_embd = setter, getter, n_embd
        self.kept: set[int] = set()

    @classmethod
    def find(cls, llama_cpp, n_embd: int, architecture: str) -> "LayerInputs | None":
        """The reader for a model of ``architecture`` (GGUF ``general.architecture``), or None where it cannot
        have one: another architecture, a build without the functions, or VERISPEC_LLAMACPP_LAYER_INPUTS=0 (the
        callback instead, for comparisons)."""
        if architecture not in cls.ARCHITECTURES or os.environ.get("VERISPEC_LLAMACPP_LAYER_INPUTS", "1") == "0":
            return None
        lib = getattr(getattr(llama_cpp, "llama_cpp", llama_cpp), "_lib", None)
        try:
            setter, getter = getattr(lib, cls.SET), getattr(lib, cls.GET)
        except (AttributeError, TypeError):
            return None
        setter.argtypes, setter.restype = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_bool], None
        getter.argtypes, getter.restype = [ctypes.c_void_p, ctypes.c_uint32], ctypes.POINTER(ctypes.c_float)
        return cls(setter, getter, n_embd)

    def keep(self, ctx, layers) -> None:
        """Make every later pass keep the inputs of ``layers`` (with those already kept). They stay on: switching
        them per pass rebuilds llama.cpp's graph (several ms a pass, docs/llamacpp.md), while keeping rows nobody
        reads costs a copy of a few KB a token."""
        for layer in layers:
            if layer not in self.kept:
                self._set(ctx, layer, True)
                self.kept.add(layer)

    def read(self, ctx, layer: int, rows: int) -> torch.Tensor:
        """The last pass's input of ``layer``, its ``rows`` rows (every token of the pass), [rows, n_embd]."""
        ptr = self._get(ctx, layer)
        if not ptr:
            raise RuntimeError(f"llama.cpp returned no input of layer {layer} for a pass that asked for it")
        return torch.from_numpy(np.ctypeslib.as_array(ptr, shape=(rows, self.n_embd)).copy())


def architecture(llama_cpp, model) -> str:
    """A loaded model's GGUF ``general.architecture`` ("llama", "qwen3", ...; "" where it has none)."""
    buf = ctypes.create_string_buffer(128)
    n = llama_cpp.llama_model_meta_val_str(model, b"general.architecture", buf, len(buf))
    return buf.value.decode() if n >= 0 else ""
