"""The llama.cpp backend: a GGUF file run by llama.cpp (through llama-cpp-python's low-level API) as the target.

What CPU users run today is llama.cpp on a GGUF file; this backend puts verispec's drafters, strict acceptance,
controller, audit and server on top of it. One ``llama_decode`` per step feeds the pending token and the drafts
with logits requested for every one of them; rollback removes the KV cells past the accepted position
(``llama_memory_seq_rm``). Each KV cache is one llama.cpp sequence id of a shared context (a unified KV buffer),
so a decoder, its reused prompt cache and an audit's teacher forcing can coexist; calls into the context are
serialised by a lock.

Weights: the GGUF file as it is, or converted once (cached) to another format with llama.cpp's own quantizer
(``--weights f32|f16|bf16|q8_0|q4_0``): on CPUs whose quantized kernels are compute-bound a wide verify pass is far
cheaper in F16/F32 (docs/llamacpp.md). The tokenizer is transformers' reading of the same GGUF file, so token
ids and the chat template are the transformers backend's exactly (tests check llama.cpp's own tokenizer agrees).
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import logging
import os
import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import InvalidRequest, ModelNotFound
from ..options import Option
from . import timing
from .base import BorrowedEmbeddings, TargetPass
from .llamacpp_states import FeatureTap, LayerInputs, architecture
from .references import is_gguf
from .registry import BackendSpec, register
from .timing import AUTO_CONTEXT, AUTO_PREFILL, AUTO_WIDTHS, auto_score, default_threads, time_passes  # noqa: F401 (re-exported)

log = logging.getLogger(__name__)

INSTALL_HINT = 'pip install "verispec[llamacpp]"  (builds llama-cpp-python from source, ~5 min on 2 cores)'
# weight formats: name -> llama.cpp file type (None: the file as it is)
WEIGHT_FORMATS = {"as-is": None, "f32": 0, "f16": 1, "bf16": 32, "q8_0": 7, "q4_0": 2, "q4_1": 3}
WEIGHT_CHOICES = ("as-is", "auto", *(f for f in WEIGHT_FORMATS if f != "as-is"))  # what --weights takes
DEFAULT_CONTEXT = 8192  # positions of the shared KV buffer (all sequences together), capped by the model's own
DEFAULT_SEQUENCES = 8  # KV sequences one context holds at once (decoders, reused prompts, audits)


def import_llama_cpp():
    """llama_cpp, with its C library's log lines kept off the user's output; a clear error when it is missing."""
    try:
        import llama_cpp
    except ImportError as exc:
        raise InvalidRequest(f"the llamacpp backend needs llama-cpp-python: {INSTALL_HINT}") from exc
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # its log callback prints below this level
    return llama_cpp


# llama.cpp built for an explicit instruction set, AMX left out: what to rebuild with where a native build crashes
# (an Intel Xeon with AMX: ``-march=native`` builds fault in the AMX matmul on the first pass; docs/llamacpp.md)
NO_AMX_CMAKE_ARGS = ("-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON "
                     "-DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON")
REBUILD = (f'CMAKE_ARGS="{NO_AMX_CMAKE_ARGS}" pip install --force-reinstall --no-cache-dir --no-deps '
           '"llama-cpp-python==0.3.36"')


def _probe_code(path: Path, threads: int, extra_buffers: bool = True) -> str:
    """A child's script: load ``path`` and run a 4-token pass, as the first real pass would (``extra_buffers``
    False: loaded as ``no_extra_buffers`` loads it)."""
    return ("import llama_cpp\n"
            "from verispec.backends.llamacpp import no_extra_buffers\n"
            f"with no_extra_buffers(llama_cpp, off={not extra_buffers}):\n"
            f"    llm = llama_cpp.Llama(model_path={str(path)!r}, n_ctx=64, n_batch=16, n_threads={threads}, "
            "verbose=False)\n"
            "llm.eval([1, 2, 3, 4])\n")


def ensure_runs(path: Path, threads: int) -> bool:
    """Whether llama.cpp's extra buffer types (weights repacked for its AMX and interleaved kernels) may be used for
    ``path`` on this CPU. A first pass that kills a child process with them is tried again without them (what
    llama-server's ``--no-repack`` does): if that runs, False, with a warning naming the rebuild that brings the
    repacked kernels back; if it crashes too, refused with the cause and the rebuild command. ``probe``: once per
    build, CPU and set of weight types."""
    from .probe import probe

    llama_cpp = import_llama_cpp()
    lib = Path(llama_cpp.__file__).parent / "lib"
    files = sorted(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in lib.glob("*.so*")) \
        if lib.is_dir() else []
    build = hashlib.sha256("|".join(files).encode()).hexdigest()[:16]  # the libraries as built
    key = {"llama_cpp": getattr(llama_cpp, "__version__", "?"), "build": build, "types": _weight_types(path),
           "threads": threads}
    result = probe("llama.cpp's first pass", key, _probe_code(path, threads))
    if result.ok:
        return True
    plain = probe("llama.cpp's first pass without extra buffer types", key,
                  _probe_code(path, threads, extra_buffers=False))
    if plain.ok:
        log.warning("llama.cpp crashed on this CPU (%s) with its repacked (AMX) weight buffers; running %s without "
                    "them, as llama-server's --no-repack does. To get the repacked kernels back, rebuild without "
                    "AMX:\n    %s", result.reason, path.name, REBUILD)
        return False
    raise InvalidRequest(
        f"llama.cpp crashed on this CPU ({result.reason}; without extra buffer types too: {plain.reason}) running a "
        f"pass over {path.name}: this llama-cpp-python build cannot run here. On Intel CPUs with AMX a native build "
        f"faults in its AMX kernels; rebuild it without them:\n    {REBUILD}\n(or use --backend openvino / "
        "transformers)")


@contextmanager
def no_extra_buffers(llama_cpp, off: bool = True):
    """While open (and ``off``), the models ``llama_cpp.Llama`` loads keep their weights in plain CPU buffers
    (llama.cpp's ``use_extra_bufts`` false): no repacking, no AMX tiles."""
    module = llama_cpp.llama_cpp
    defaults = module.llama_model_default_params
    if not off:
        yield
        return

    def params():
        p = defaults()
        p.use_extra_bufts = False
        return p

    module.llama_model_default_params = params
    try:
        yield
    finally:
        module.llama_model_default_params = defaults


def _weight_types(path: Path) -> list[str]:
    """The tensor types a GGUF file holds (what decides which of llama.cpp's kernels its passes run), from its tensor
    table alone (``gguf_header``: gguf's reader decodes the whole vocabulary too, seconds a load; docs/kernels.md)."""
    from .gguf_header import type_bytes

    try:
        return sorted(type_bytes(path))
    except Exception:  # an unreadable header: the load itself will say so
        return []


def convert_weights(source: Path, fmt: str, folder: Path) -> Path:
    """``source`` rewritten in weight format ``fmt`` by llama.cpp's quantizer, once (cached in ``folder``)."""
    if fmt not in WEIGHT_FORMATS:
        raise InvalidRequest(f"unknown weight format {fmt!r}; choose one of {', '.join(WEIGHT_FORMATS)} or auto")
    if WEIGHT_FORMATS[fmt] is None:
        return source
    target = folder / f"{source.stem}.{fmt}.gguf"
    if target.exists():
        return target
    llama_cpp = import_llama_cpp()
    folder.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".{os.getpid()}.partial")  # processes converting at once never share one
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = WEIGHT_FORMATS[fmt]
    params.allow_requantize = True  # the source may be quantized already (the built-in file is Q4_1)
    params.nthread = default_threads()
    log.warning("converting %s to %s weights in %s (once) ...", source.name, fmt, target)
    status = llama_cpp.llama_model_quantize(str(source).encode(), str(partial).encode(), ctypes.byref(params))
    if status != 0 or not partial.exists():
        partial.unlink(missing_ok=True)
        raise ModelNotFound(f"llama.cpp could not convert {source} to {fmt} (status {status})")
    os.replace(partial, target)  # another process's finished file holds the same conversion
    return target


@dataclass
class _Batch:
    """A reusable llama_batch with room for ``size`` tokens of one sequence each."""

    size: int
    raw: object = None

    def fill(self, llama_cpp, tokens, start: int, seq: int, logits_from: int) -> None:
        b = self.raw
        for i, token in enumerate(tokens):
            b.token[i] = token
            b.pos[i] = start + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = i >= logits_from
        b.n_tokens = len(tokens)

    def fill_many(self, llama_cpp, items) -> None:
        """Tokens of several sequences, each after its cached positions, with logits for every one."""
        b, i = self.raw, 0
        for kv, tokens in items:
            for j, token in enumerate(tokens):
                b.token[i] = token
                b.pos[i] = kv.length + j
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = kv.seq
                b.logits[i] = True
                i += 1
        b.n_tokens = i


class LlamaKVGroup:
    """The llama.cpp backend's ``KVGroup``: sequences of one context (any of them can share a pass)."""
    keeps_positions = False  # no keep(): a tree step is fed again (KVCache)

    def __init__(self, model: "LlamaCppModel", capacity: int) -> None:
        self.model, self.capacity = model, capacity

    def new_kv(self) -> "LlamaKV":
        return self.model.new_kv()

    def copy_prefix(self, source: "LlamaKV", target: "LlamaKV", length: int) -> None:
        """``target`` (empty) shares the first ``length`` cells of ``source`` (llama.cpp's seq_cp: no copy)."""
        if len(target):
            raise ValueError(f"the target sequence already holds {len(target)} positions")
        if not 0 <= length <= len(source):
            raise ValueError(f"cannot copy {length} positions from a sequence of {len(source)}")
        if length:
            self.model._copy(source.seq, target.seq, length)
        target.length = length


class LlamaKV:
    """One sequence of a llama.cpp context: the ``KVCache`` of this backend (freed when dropped)."""

    def __init__(self, model: "LlamaCppModel", seq: int) -> None:
        self.model, self.seq, self.length = model, seq, 0
        self._finalizer = weakref.finalize(self, model._release, seq)

    def __len__(self) -> int:
        return self.length

    def truncate(self, length: int) -> None:
        if length > self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} positions to {length}")
        if length < self.length:
            self.model._remove(self.seq, length)
            self.length = length

    def close(self) -> None:
        self._finalizer()  # the sequence goes back to the context's free list (once)


class LlamaCppModel(BorrowedEmbeddings):
    """A GGUF model run by llama.cpp: the llamacpp backend of ``verispec.backends.base.TargetModel``."""

    backend = "llamacpp"
    supports_trees = False
    host_threads = 1  # torch's share while this backend's own threads run passes (base.host_threads)
    supports_features = False
    hidden_states_cost_logits = True  # a row's hidden state comes with its logits only
    final_feature_layer: int  # hidden_states[n_layer], the final normed state: returned with or without ``features``
    dtype = torch.float32  # logits come as float32; the weights' format is ``weights``

    @property
    def changed_model(self) -> str:
        return f"llama.cpp {self.weights} re-quantizes the weights" if str(self.weights).startswith("q") else ""

    def __init__(self, path: Path, tokenizer, name: str, *, weights: str = "as-is", threads: int | None = None,
                 context: int | None = None, sequences: int = DEFAULT_SEQUENCES, batch: int = 512,
                 features: bool = False, embedding_model=None) -> None:
        """Hidden states of any layer come from llama.cpp's layer-input outputs where this build and the model's
        architecture have them (``LayerInputs``: no callback, next to nothing paid by passes that ask for none); the
        final normed state (``final_feature_layer``) from its embeddings output of the passes that ask for it.
        Elsewhere ``features=True`` installs the eval callback instead (it costs a Python call per graph node on
        every pass, so it is off otherwise), and without it only the final state comes back.
        ``embedding_model()`` loads a transformers model with the same embeddings and lm_head, which heads
        borrow."""
        llama_cpp = import_llama_cpp()
        self._llama = llama_cpp
        self.path, self.tokenizer, self.name, self.weights = Path(path), tokenizer, name, weights
        self.threads = threads or default_threads()
        # a build that crashes on this CPU runs without extra buffer types, or is refused: never run to a crash
        self.extra_buffers = ensure_runs(self.path, self.threads)
        llama_cpp.llama_backend_init()
        mparams = llama_cpp.llama_model_default_params()
        mparams.use_extra_bufts = self.extra_buffers
        self._model = llama_cpp.llama_model_load_from_file(str(self.path).encode(), mparams)
        if not self._model:
            raise ModelNotFound(f"llama.cpp could not load {self.path}")
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)
        trained = int(llama_cpp.llama_model_n_ctx_train(self._model))
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = min(context or DEFAULT_CONTEXT, trained) if trained > 0 else (context or DEFAULT_CONTEXT)
        cparams.n_batch = cparams.n_ubatch = batch
        cparams.n_seq_max = sequences
        cparams.kv_unified = True  # every sequence may use the whole window
        cparams.n_threads = cparams.n_threads_batch = self.threads
        self._tap = None
        self.final_feature_layer = int(llama_cpp.llama_model_n_layer(self._model))
        self._n_embd = int(llama_cpp.llama_model_n_embd(self._model))
        self.architecture = architecture(llama_cpp, self._model)
        self._inputs = LayerInputs.find(llama_cpp, self._n_embd, self.architecture)
        if features and self._inputs is None:
            self._tap = FeatureTap(self.final_feature_layer)
            self._tap.callback = llama_cpp.ggml_backend_sched_eval_callback(self._tap)
            cparams.cb_eval = self._tap.callback
        self.supports_features = features or self._inputs is not None
        self.sequences = sequences
        self._embedding_model_loader, self._embedding_model = embedding_model, None
        # Flash attention off (llama-cpp-python's default too) and, for F32 weights, an F32 KV cache: then a row's
        # logits barely depend on how many tokens share its pass (measured max difference 3e-5 between a 9-token
        # and nine 1-token passes), which is what keeps greedy speculation identical to plain decoding. Quantized
        # kernels round differently at different widths whatever these settings are (docs/llamacpp.md).
        cparams.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        self.kv_type = "f16"
        if llama_cpp.llama_model_ftype(self._model) == 0:  # LLAMA_FTYPE_ALL_F32
            cparams.type_k = cparams.type_v = 0  # GGML_TYPE_F32
            self.kv_type = "f32"
        self._ctx = llama_cpp.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            raise ModelNotFound(f"llama.cpp could not create a context for {self.path}")
        self._memory = llama_cpp.llama_get_memory(self._ctx)
        self._embeddings_on = False  # llama.cpp's embeddings output (the final normed state); see _decode_batch
        self._n_ctx = int(llama_cpp.llama_n_ctx(self._ctx))
        self._n_vocab = int(llama_cpp.llama_vocab_n_tokens(self._vocab))
        self._batch = _Batch(batch, llama_cpp.llama_batch_init(batch, 0, 1))
        self._lock = threading.RLock()
        self._free = list(range(sequences - 1, -1, -1))
        eos = {int(t) for t in (llama_cpp.llama_vocab_eos(self._vocab), llama_cpp.llama_vocab_eot(self._vocab)) if t >= 0}
        value = getattr(tokenizer, "eos_token_id", None)
        eos |= {value} if isinstance(value, int) else set()
        self.eos_token_ids = frozenset(eos)
        weakref.finalize(self, _free_llama, llama_cpp, self._batch.raw, self._ctx, self._model)

    # ------------------------------------------------------------ facts
    @property
    def vocab_size(self) -> int:
        return self._n_vocab

    @property
    def context_length(self) -> int:
        return self._n_ctx

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def kernel(self) -> str:
        return f"llama.cpp ({self.weights} weights, {self.kv_type} KV cache, {self.threads} threads)"

    @property
    def cost_key(self) -> object:
        return self

    @property
    def measurement_key(self) -> dict:
        """What a pass's cost depends on here (``verispec.backends.measurements``)."""
        from . import measurements

        return {**measurements.machine(), "backend": self.backend, "model": measurements.file_fingerprint(self.path),
                "weights": self.weights, "threads": self.threads, "features": self.supports_features,
                "kv_type": self.kv_type, "llama_cpp": self._llama.__version__}

    # ------------------------------------------------------------ KV sequences
    def new_kv(self, trees: bool = False) -> LlamaKV:  # trees: refused before any cache (supports_trees)
        with self._lock:
            if not self._free:
                raise InvalidRequest(f"all {self.sequences} llama.cpp sequences are in use; raise "
                                     "sequences= when loading the model")
            seq = self._free.pop()
        return LlamaKV(self, seq)

    def _remove(self, seq: int, start: int) -> None:
        with self._lock:
            if not self._llama.llama_memory_seq_rm(self._memory, seq, start, -1):
                raise RuntimeError(f"llama.cpp could not remove positions >= {start} of sequence {seq}")

    def _copy(self, source: int, target: int, length: int) -> None:
        with self._lock:
            self._llama.llama_memory_seq_cp(self._memory, source, target, 0, length)

    def _release(self, seq: int) -> None:
        with self._lock:
            self._llama.llama_memory_seq_rm(self._memory, seq, -1, -1)
            self._free.append(seq)

    # ------------------------------------------------------------ the pass
    def forward(self, kv: LlamaKV, tokens, *, parents=None, last_only: bool = False, feature_layers=()) -> TargetPass:
        if parents is not None:
            raise InvalidRequest("the llamacpp backend verifies chains only; token trees need --backend transformers")
        inputs, names, embeddings = self._feature_plan(feature_layers)
        tokens = list(tokens)
        if not tokens:
            raise ValueError("forward needs at least one token")
        if kv.length + len(tokens) > self._n_ctx:
            raise InvalidRequest(f"{kv.length + len(tokens)} positions exceed the llama.cpp context of {self._n_ctx}")
        rows: list[torch.Tensor] = []
        # the last layer's rows exist only where logits are asked for
        all_logits = not last_only or self.final_feature_layer in feature_layers
        finals: list[torch.Tensor] | None = [] if embeddings else None
        layer_rows = {layer: [] for layer in inputs} if inputs else None
        hidden = None
        with self._lock:
            if names:
                self._tap.wanted = {n: [] for n in names}
            try:
                self._decode(kv, tokens, all_logits, rows, finals, last_only, layer_rows)
                if names:
                    hidden = torch.stack([torch.cat(self._tap.wanted[n]) for n in names], dim=1)  # [rows, L, H]
            finally:
                if names:
                    self._tap.wanted = {}
        if inputs is not None:
            hidden = self._stack_features(feature_layers, finals, {k: torch.cat(v) for k, v in layer_rows.items()})
        elif finals is not None:
            hidden = torch.cat(finals)[:, None].expand(-1, len(feature_layers), -1)  # [rows, L, H], L copies
        logits = torch.cat(rows) if len(rows) > 1 else rows[0]
        if last_only:
            logits = logits[-1:]
        return TargetPass(logits, hidden)

    def _feature_plan(self, feature_layers) -> tuple[list[int] | None, list[bytes], bool]:
        """How a pass reads ``feature_layers``: (the layers read as llama.cpp's layer inputs, or None; the tensor
        names the eval callback copies; whether the final state comes from the embeddings output)."""
        if not feature_layers:
            return None, [], False
        if self._embeddings_only(feature_layers):
            return None, [], True
        inputs = self._input_layers(feature_layers)
        if inputs is not None:
            return inputs, [], self.final_feature_layer in feature_layers
        return None, [self._tap.name(i) for i in feature_layers], False

    def _embeddings_only(self, feature_layers) -> bool:
        """Whether the features asked for come from llama.cpp's embeddings output (the final normed state, no
        callback) rather than the eval callback; a layer the model cannot return is refused."""
        if not feature_layers:
            return False
        if all(i == self.final_feature_layer for i in feature_layers):
            return True  # with or without the callback: the embeddings output costs no Python per graph node
        if self._tap is None and self._inputs is None:
            raise InvalidRequest(f"llama.cpp gives no layer inputs for this model (verispec reads them for the "
                                 f"{' and '.join(sorted(LayerInputs.ARCHITECTURES))} architectures, on builds that have "
                                 f"llama_set_embeddings_layer_inp; this one is {self.architecture or 'unnamed'}) and it "
                                 f"was loaded without the eval callback, so it returns only the final hidden state "
                                 f"(layer {self.final_feature_layer}), not layers {list(feature_layers)}; load it with "
                                 "features=True (the CLI does that for --drafter eagle with such a head)")
        return False

    def _input_layers(self, feature_layers) -> list[int] | None:
        """The layers (all but the final state) read as llama.cpp's layer inputs, or None where the callback reads
        them (a build without layer inputs)."""
        if self._inputs is None:
            return None
        for i in feature_layers:
            if not 0 <= i <= self.final_feature_layer:
                raise InvalidRequest(f"hidden-state layer {i} is outside 0..{self.final_feature_layer}")
        return sorted({i for i in feature_layers if i != self.final_feature_layer})

    def _stack_features(self, feature_layers, finals, inputs: dict[int, torch.Tensor]) -> torch.Tensor:
        """[rows, L, H] in ``feature_layers``' order from the final states and the layer inputs read."""
        final = torch.cat(finals) if finals else None
        return torch.stack([final if i == self.final_feature_layer else inputs[i] for i in feature_layers], dim=1)

    def new_kv_group(self, capacity: int) -> LlamaKVGroup:
        if capacity > self.sequences:
            raise InvalidRequest(f"a batch of {capacity} sequences needs a context with at least that many; load "
                                 f"the model with sequences={capacity} or more (this one has {self.sequences})")
        return LlamaKVGroup(self, capacity)

    def pass_width(self, widths) -> int:
        """Tokens a batched pass computes: llama.cpp batches ragged rows without padding."""
        return sum(widths)

    def forward_batch(self, items, *, feature_layers=()) -> list[TargetPass]:
        """Several sequences in one ``llama_decode`` (split only where the tokens exceed the batch size)."""
        inputs, names, embeddings = self._feature_plan(feature_layers)
        items = [(kv, list(tokens)) for kv, tokens in items]
        for kv, tokens in items:
            if not tokens:
                raise ValueError("every sequence of a batched pass needs at least one token")
            if len(tokens) > self._batch.size:
                raise ValueError(f"a batched pass takes at most {self._batch.size} tokens per sequence")
            if kv.length + len(tokens) > self._n_ctx:
                raise InvalidRequest(f"{kv.length + len(tokens)} positions exceed the llama.cpp context of "
                                     f"{self._n_ctx}")
        groups, group, size = [], [], 0
        for item in items:  # consecutive items that fit one llama_batch
            if group and size + len(item[1]) > self._batch.size:
                groups.append(group)
                group, size = [], 0
            group.append(item)
            size += len(item[1])
        groups.append(group)
        passes: list[TargetPass] = []
        llama_cpp = self._llama
        with self._lock:
            for group in groups:
                if names:
                    self._tap.wanted = {n: [] for n in names}
                try:
                    self._batch.fill_many(llama_cpp, group)
                    status = self._decode_batch(embeddings, inputs or ())
                    if status != 0:
                        raise RuntimeError(f"llama_decode failed with status {status} (a batch of {len(group)} "
                                           "sequences)")
                    total = sum(len(t) for _, t in group)
                    ptr = llama_cpp.llama_get_logits(self._ctx)
                    logits = torch.from_numpy(np.ctypeslib.as_array(ptr, shape=(total, self._n_vocab)).copy())
                    hidden = (torch.stack([torch.cat(self._tap.wanted[n]) for n in names], dim=1) if names else None)
                    if inputs is not None:
                        hidden = self._stack_features(
                            feature_layers, [self._read_embeddings(total)] if embeddings else None,
                            {layer: self._inputs.read(self._ctx, layer, total) for layer in inputs})
                    elif embeddings:
                        hidden = self._read_embeddings(total)[:, None].expand(-1, len(feature_layers), -1)
                finally:
                    if names:
                        self._tap.wanted = {}
                start = 0
                for kv, tokens in group:
                    rows = slice(start, start + len(tokens))
                    passes.append(TargetPass(logits[rows], hidden[rows] if hidden is not None else None))
                    kv.length += len(tokens)
                    start += len(tokens)
        return passes

    def _decode_batch(self, embeddings: bool, layers=()) -> int:
        """``llama_decode`` of the filled batch; with ``embeddings`` the final normed state of every row that asks
        for logits is kept too, and the inputs of ``layers`` for every row (``LayerInputs.keep``). The embeddings
        output is switched only when a pass wants otherwise than the one before: a switch costs llama.cpp a graph
        rebuild on the next pass (final-state passes in a row cost what plain ones do; docs/llamacpp.md), so a head's decoding pays no switch per step and
        plain decoding pays nothing."""
        llama_cpp = self._llama
        if embeddings != self._embeddings_on:
            llama_cpp.llama_set_embeddings(self._ctx, embeddings)
            self._embeddings_on = embeddings
        if layers:
            self._inputs.keep(self._ctx, layers)
        return llama_cpp.llama_decode(self._ctx, self._batch.raw)

    def _read_embeddings(self, rows: int) -> torch.Tensor:
        """The last pass's final normed states of its ``rows`` output rows, [rows, n_embd]."""
        ptr = self._llama.llama_get_embeddings(self._ctx)
        if not ptr:
            raise RuntimeError("llama.cpp returned no embeddings for a pass that asked for them")
        return torch.from_numpy(np.ctypeslib.as_array(ptr, shape=(rows, self._n_embd)).copy())

    def _decode(self, kv: LlamaKV, tokens: list[int], all_logits: bool, rows: list,
                finals: list | None = None, last_only: bool = False, layer_rows: dict | None = None) -> None:
        """Feed ``tokens`` in chunks of the batch size; append logits (every row, or the last one) to ``rows``, and
        with ``finals`` (every row's logits asked for) the final normed states to it; with ``last_only`` only the
        last row's logits are copied out (a prefill that reads every row's state: 150 MB of logits for 770 rows)."""
        llama_cpp, size = self._llama, self._batch.size
        want = 0 if all_logits else len(tokens) - 1  # first row (of all tokens) whose logits we keep
        for start in range(0, len(tokens), size):
            chunk = tokens[start : start + size]
            first = min(max(0, want - start), len(chunk))  # len(chunk): no logits from this chunk
            self._batch.fill(llama_cpp, chunk, kv.length, kv.seq, first)
            status = self._decode_batch(finals is not None, list(layer_rows) if layer_rows else ())
            if status != 0:
                raise RuntimeError(f"llama_decode failed with status {status} ({len(chunk)} tokens after "
                                   f"{kv.length} cached)")
            kv.length += len(chunk)
            if len(chunk) - first:
                if not last_only or start + size >= len(tokens):
                    ptr = llama_cpp.llama_get_logits(self._ctx)
                    logits = np.ctypeslib.as_array(ptr, shape=(len(chunk) - first, self._n_vocab))
                    rows.append(torch.from_numpy((logits[-1:] if last_only else logits).copy()))
                if finals is not None:
                    finals.append(self._read_embeddings(len(chunk) - first))
            for layer, read in (layer_rows or {}).items():
                read.append(self._inputs.read(self._ctx, layer, len(chunk)))

    # ------------------------------------------------------------ llama.cpp's own tokenizer (for checks)
    def llama_tokenize(self, text: str, add_special: bool = True) -> list[int]:
        raw = text.encode()
        buf = (self._llama.llama_token * (len(raw) + 8))()
        n = self._llama.llama_tokenize(self._vocab, raw, len(raw), buf, len(buf), add_special, True)
        if n < 0:
            raise RuntimeError("llama.cpp tokenization overflowed its buffer")
        return list(buf[:n])


def _free_llama(llama_cpp, batch, ctx, model) -> None:
    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)


# ------------------------------------------------------------------ choosing the weight format
AUTO_CANDIDATES = ("as-is", "f16", "f32")


@dataclass
class Weights:
    name: str  # the format chosen ("as-is", "f16", ...)
    path: Path
    timings_ms: dict | None = None  # auto's measurements: format -> {width: ms}


AUTO_RECORD = "llamacpp-weights"  # the kind of record auto's timings are stored as (verispec.backends.measurements)


def choose_weights(source: Path, weights: str, folder: Path, threads: int | None = None) -> Weights:
    """The weight file to run: ``source`` converted to ``weights``, or for ``auto`` the format whose measured
    pass costs promise the most tokens/s for speculation on this CPU (stored per file, CPU, threads and versions,
    beside the step costs of ``verispec.backends.measurements``; timed again where none is stored)."""
    if weights != "auto":
        return Weights(weights, convert_weights(source, weights, folder))
    from . import measurements

    threads = threads or default_threads()
    key = {**measurements.machine(), "model": measurements.file_fingerprint(source), "threads": threads,
           "candidates": list(AUTO_CANDIDATES), "v": 2}
    known = measurements.load(AUTO_RECORD, key)
    if known is None:
        timings = {fmt: time_widths(convert_weights(source, fmt, folder), threads)
                   for fmt in timing.candidates_bar(AUTO_CANDIDATES)}
        known = {"timings_ms": timings, "choice": min(timings, key=lambda f: auto_score(timings[f]))}
        measurements.save(AUTO_RECORD, key, known)
    choice = known["choice"]
    log.info("weights auto -> %s (%s)", choice, known["timings_ms"])
    return Weights(choice, convert_weights(source, choice, folder), known["timings_ms"])


def time_widths(path: Path, threads: int, widths=AUTO_WIDTHS, repeats: int = 5) -> dict[str, float]:
    """``timing.time_widths`` for the weights at ``path``."""
    model = LlamaCppModel(path, None, path.name, threads=threads, context=AUTO_CONTEXT + 64, sequences=2)
    return timing.time_widths(model, widths, AUTO_CONTEXT, AUTO_PREFILL, repeats)


def load(ref: str, weights: str = "as-is", threads: int | None = None, features: bool = False,
         sequences: int | None = None) -> LlamaCppModel:
    """A built-in name or a .gguf file on llama.cpp (see ``verispec.load_model``)."""
    from transformers import AutoTokenizer

    from .references import BUILTINS, cache_dir, ensure_tokenizer, gguf_file, sha256_of, transformers_progress_bars

    import_llama_cpp()  # a clear error naming the install command before any download
    if not is_gguf(ref):
        raise ModelNotFound(f"the llamacpp backend runs GGUF files: pass a built-in name ({', '.join(BUILTINS)}) "
                            f"or a .gguf file, not {ref!r}")
    gguf = gguf_file(ref)
    # the file's tokenizer, converted once (the transformers backend's own: identical ids and template)
    digest = BUILTINS[ref].sha256 if ref in BUILTINS else sha256_of(gguf)  # a built-in's: checked when extracted
    with transformers_progress_bars(False):
        tokenizer = AutoTokenizer.from_pretrained(str(ensure_tokenizer(ref, digest)))
    folder = cache_dir() / "gguf-weights" / f"{gguf.stem}-{digest[:16]}"
    chosen = choose_weights(gguf, weights, folder, threads)
    more = {} if sequences is None else {"sequences": sequences}

    def embedding_model():  # EAGLE heads borrow the embeddings and lm_head of a transformers copy (loaded on demand)
        from .hf import load as load_transformers

        return load_transformers(ref, pack=False).model

    return LlamaCppModel(chosen.path, tokenizer, ref, weights=chosen.name, threads=threads, features=features,
                         **more, embedding_model=embedding_model)


register(BackendSpec(
    "llamacpp",
    summary="llama.cpp on the GGUF file, as CPU users run it: every drafter, chains only",
    load=load,
    install=INSTALL_HINT,
    installed=lambda: importlib.util.find_spec("llama_cpp") is not None,
    runs_own_weights=is_gguf,
    preference=1,
    cost=lambda mix: float(sum(mix.values())),  # reads the file's bytes as they are
    options=(
        Option("weights", str, "as-is", "the GGUF's weight format; as-is (default) runs the file as shipped, "
               "f32/f16/q8_0/... convert it once (cached), auto times the candidates on this CPU once and picks the "
               "fastest for speculation", choices=WEIGHT_CHOICES, metavar="FORMAT"),
        Option("threads", int, None, "CPU threads (default: the cores this process may use)"),
        Option("features", bool, False, "hidden states of layers before the final one through an eval callback, "
               "where this llama.cpp has no layer-input outputs (EAGLE heads of four layers)", exposed=False),
        Option("sequences", int, None, f"KV sequences the context holds at once (default {DEFAULT_SEQUENCES}; a "
               "batch of N requests needs N)", exposed=False),
    ),
))
