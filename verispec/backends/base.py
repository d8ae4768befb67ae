"""The target-backend boundary: what the engine, the audit and the drafters need from a target model.

A backend runs the target: one pass over new tokens after a sequence's cached ones, logits for every position
fed, optionally the hidden states of some layers; its KV cache keeps the first n positions and drops the rest
(rollback). Two backends implement it: transformers (``verispec.backends.hf.LoadedModel``, float32/bfloat16
PyTorch, token trees, hidden states for EAGLE heads) and llama.cpp (``verispec.backends.llamacpp.LlamaCppModel``, GGUF
files as CPU users run them). The engine, verification, sampling and the drafters import this module, never a backend;
``verispec.backends.load_model`` picks one.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import NamedTuple, Protocol, Sequence, runtime_checkable

import torch

from ..errors import InvalidRequest

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise InvalidRequest(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def host_threads(target) -> int | None:
    """How many threads torch may use for the engine's own work (sampling, verification, drafters) while
    ``target`` runs its passes: None leaves torch as it is (the transformers backend is torch); 1 for backends
    with threads of their own (llama.cpp, OpenVINO), because torch's idle OpenMP workers spin for a while after
    each op and take the cores from the next pass (measured: plain decoding on OpenVINO 68 -> 82 tok/s)."""
    return getattr(target, "host_threads", None)


@contextmanager
def torch_threads(n: int | None):
    """Run the block with torch limited to ``n`` intra-op threads (None: unchanged), then restore them."""
    old = torch.get_num_threads()
    if n is None or n >= old:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


class TargetModelBase:
    """Defaults of ``TargetModel``'s optional parts. Every backend's model class derives from it, so the engine and
    the drafters call them as they are, never looking them up: a backend overrides what it has."""

    supports_trees = False
    supports_features = False
    final_feature_layer: int | None = None  # a hidden-state layer returned without asking at load time (llama.cpp)
    supports_layer_skipping = False  # ``without_layers(skip)``: a view running a subset of its layers (layerskip)
    # a row's hidden state comes only with that row's logits (llama.cpp): heads read a prompt's last rows only
    hidden_states_cost_logits = False
    openvino_core = None  # the ``openvino.Core`` its graphs run in, if any: an EAGLE head's graph joins it
    compiles_steps = False  # its one-token step may run compiled (``step``), now or once compiled in the background
    step = None  # that compiled step, while it runs one

    @property
    def changed_model(self) -> str:
        """Why the weights it runs are not the model's own (a format that quantizes them again), or "" when they
        are: every result made with such a target says so, as the lossy acceptance rule does."""
        return ""

    @property
    def cost_state(self) -> object:
        return None  # passes always run the same way

    @property
    def programs_loading(self) -> bool:
        return False  # nothing loads in the background

    def prepare(self, feature_layers: Sequence[int] = (), width: int | None = None, trees: bool = False) -> None:
        """Ready the passes of up to ``width`` tokens, returning those layers' hidden states (token trees: with
        ``trees``), before a first request needs them (the OpenVINO backend compiles its graphs then)."""


class BorrowedEmbeddings(TargetModelBase):
    """For backends whose weights are not a transformers model: ``embedding_model`` loads a transformers copy of the
    same weights on first use (drafters such as EAGLE heads borrow its embeddings and lm_head). The backend sets
    ``_embedding_model_loader`` (None: no copy available) and ``_embedding_model = None``."""

    name: str
    _embedding_model = None
    _embedding_model_loader = None

    @property
    def embedding_model(self):
        if self._embedding_model is None:
            if self._embedding_model_loader is None:
                raise InvalidRequest(f"no transformers copy of {self.name} is available for its embeddings")
            self._embedding_model = self._embedding_model_loader()
        return self._embedding_model


class TargetPass(NamedTuple):
    logits: torch.Tensor  # [rows, vocab] float32: a row per fed token (only the last one when last_only)
    hidden: torch.Tensor | None = None  # [rows, layers, hidden] at the requested layers, or None


@runtime_checkable
class KVCache(Protocol):
    """One sequence's cached keys/values. ``len`` is the number of cached positions."""

    def __len__(self) -> int: ...

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` positions, drop the rest (raises if ``length`` exceeds what is cached)."""

    def close(self) -> None:
        """Give the cache's memory back (it may not be used after)."""

    # Declared by each cache type: whether it has ``keep(start, positions)``, which keeps the first ``start``
    # positions and then ``positions`` (ascending, each >= start) moved to follow them, and drops the rest: a token
    # tree's accepted path stays cached. Without it the engine drops every node and feeds the path again.
    keeps_positions: bool


@runtime_checkable
class KVGroup(Protocol):
    """Caches of up to ``capacity`` sequences that can share one pass (``TargetModel.forward_batch``)."""

    capacity: int

    def new_kv(self) -> KVCache:
        """A cache for one more sequence of the group (``close()`` it when the sequence leaves)."""

    def copy_prefix(self, source: KVCache, target: KVCache, length: int) -> None:
        """Give the empty cache ``target`` the first ``length`` positions of ``source`` (both of this group): a
        request that shares a prompt prefix with another skips its prefill."""


@runtime_checkable
class TargetModel(Protocol):
    """A target causal LM behind one of the backends."""

    name: str
    backend: str  # its registered backend's name (``verispec.backends.registry``): for messages and records only
    tokenizer: object  # a transformers tokenizer (same ids and chat template on every backend)
    dtype: torch.dtype  # of the logits' computation as reported ("float32" for GGUF weights run by llama.cpp)
    eos_token_ids: frozenset[int]
    supports_trees: bool  # can verify a token tree in one pass (tree attention mask)
    supports_features: bool  # can return hidden states of any layers (EAGLE heads); see ``provides_features``

    @property
    def vocab_size(self) -> int: ...

    @property
    def context_length(self) -> int | None: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def kernel(self) -> str:
        """What runs the linear layers, for reports."""

    @property
    def cost_key(self) -> object:
        """A weak-referenceable object that identifies the weights (the controller keeps one cost curve per key)."""

    @property
    def cost_state(self) -> object:
        """Optional: how passes run now, where that can change in a process (a compiled program arriving); the
        controller keeps a cost curve per state. None, or no such attribute: passes always run the same way."""
        return None

    @property
    def programs_loading(self) -> bool:
        """Optional: whether a program that will change how passes run (``cost_state``) is loading in the background
        now; the engine does not time passes for a curve that is about to be left. No such attribute: False."""
        return False

    @property
    def measurement_key(self) -> dict | None:
        """Everything a pass's cost depends on (weights, format, dtype, threads, CPU, versions): the key its measured
        costs are stored under for later processes (``verispec.backends.measurements``); None: never stored."""

    @property
    def embedding_model(self) -> torch.nn.Module:
        """A transformers model with the target's input embedding, lm_head and config (EAGLE heads borrow them)."""

    def new_kv(self, trees: bool = False) -> KVCache:
        """A cache for one sequence; ``trees``: its passes may be token trees (``forward(parents=...)``), which
        some backends run on another graph (OpenVINO's paged attention is causal only)."""

    def forward(self, kv: KVCache, tokens: Sequence[int], *, parents: Sequence[int] | None = None,
                last_only: bool = False, feature_layers: Sequence[int] = ()) -> TargetPass:
        """Run ``tokens`` after the ``len(kv)`` cached positions and cache them. With ``parents`` the last
        ``len(parents)`` tokens are a tree (see ``verispec.tree``) and the others a causal prefix."""

    def new_kv_group(self, capacity: int) -> KVGroup: ...

    def forward_batch(self, items: Sequence[tuple[KVCache, Sequence[int]]], *,
                      feature_layers: Sequence[int] = ()) -> list[TargetPass]:
        """One pass over several sequences of one group: each item's tokens after that sequence's cached
        positions (ragged: any number >= 1 each), cached; logits for every fed token, per item, in order."""

    def pass_width(self, widths: Sequence[int]) -> int:
        """The tokens a batched pass over rows of these widths computes (padding included): what its cost
        depends on."""

    def prepare(self, feature_layers: Sequence[int] = (), width: int | None = None, trees: bool = False) -> None:
        """Optional (``TargetModelBase``: nothing to ready): ready the passes a first request needs."""


def provides_features(target, layers) -> bool:
    """Whether ``target`` returns the hidden states at ``layers`` (indices into transformers' ``hidden_states``):
    a backend that ``supports_features`` returns any; one with a ``final_feature_layer`` (llama.cpp, whose
    embeddings output is the final normed state) returns that one without being asked at load time."""
    if target.supports_features:
        return True
    final = target.final_feature_layer
    return final is not None and all(i == final for i in layers)
