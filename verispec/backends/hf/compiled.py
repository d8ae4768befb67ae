"""An opt-in one-token decoder step compiled by inductor, over a KV cache of fixed buffers with rollback.

On CPU a one-token step is bound by streaming the weights. oneDNN's packed kernels stream them at about half the
memory bandwidth; inductor's CPU GEMM template with frozen weights (``max_autotune`` + ``freezing``) gets closer, and
compiling the whole step also fuses the norms, rotary and attention around the linears. Measured on an AMD EPYC
(Zen 4, 2 cores) with the default model: 17-25 ms against 40-43 ms for the eager packed step at 100 to 1,500
cached tokens (docs/kernels.md). Wider passes gain nothing from it, so prefill and verification stay eager
(packed) over the same cache; both are checked against a fresh forward over the whole sequence in
tests/test_compiled.py and tests/test_e2e_compiled.py.

The cache is transformers' ``StaticLayer`` with a length that can be set back (``FixedLayer``): every pass writes
at the sequence's length and attends through an explicit mask that hides the columns past each token's position,
so rolled-back positions are never read and the next pass overwrites them. The compiled step attends over the
whole buffer, whose size is marked dynamic, so one graph serves every sequence length; the buffer grows in steps
of ``GROWTH``. Eager passes attend over the columns they need only. The
compiled copy of the model attends through ``one_token_attention``, which reads each KV head once.

Compiling takes about a minute per model and process (freezing bypasses inductor's on-disk cache);
``LoadedModel.compile_step`` does it at load, before the first request, so that no user's first token pays it.
"""

from __future__ import annotations

import copy
import logging
import time
from contextlib import contextmanager

import torch
import torch._inductor.config as inductor_config
from torch import nn
from transformers import AttentionInterface, Cache, StaticLayer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .masks import for_layers

log = logging.getLogger(__name__)

GROWTH = 256  # a cache's capacity is a multiple of this many positions: the fewest that hold its sequence


class FixedLayer(StaticLayer):
    """A ``StaticLayer`` that writes at its ``cumulative_length`` and can be set back to any shorter length.

    Its buffers are plain tensors (not marked as static addresses), so a compiled graph takes each new cache as an
    input instead of recompiling for it. An eager pass sets ``columns`` to attend over the positions it needs only
    (``FixedKV.eager``)."""

    columns: int | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch_size, self.num_heads = key_states.shape[:2]
        self.k_head_dim, self.v_head_dim = key_states.shape[-1], value_states.shape[-1]
        self.cumulative_length = self.cumulative_length.to(self.device)
        self._allocate(self.max_cache_len, key_states, value_states)
        self.is_initialized = True

    def _allocate(self, capacity: int, key_like: torch.Tensor, value_like: torch.Tensor) -> None:
        self.max_cache_len = capacity
        self.keys = _dynamic_columns(key_like.new_zeros((self.batch_size, self.num_heads, capacity, self.k_head_dim)), 2)
        self.values = _dynamic_columns(
            value_like.new_zeros((self.batch_size, self.num_heads, capacity, self.v_head_dim)), 2)

    def set_length(self, length: int) -> None:
        self.cumulative_length.fill_(length)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        if self.columns is None:  # a compiled pass: the whole buffer (its size is the graph's dynamic dimension)
            return keys, values
        return keys[:, :, : self.columns], values[:, :, : self.columns]

    def resize(self, capacity: int, keep: int) -> None:
        """Move the first ``keep`` positions into new buffers of ``capacity`` positions."""
        if not self.is_initialized:
            self.max_cache_len = capacity
            return
        keys, values = self.keys, self.values
        self._allocate(capacity, keys, values)
        self.keys[:, :, :keep].copy_(keys[:, :, :keep])
        self.values[:, :, :keep].copy_(values[:, :, :keep])


class FixedKV:
    """One sequence's cache in buffers of ``capacity`` positions (a ``verispec.backends.base.KVCache``). A pass that needs
    more room first moves the cache into buffers of the next multiple of ``GROWTH`` positions, so the buffers hold
    at most ``GROWTH`` unused columns: attention reads all of them (a compiled graph has no data-dependent length),
    and each costs about as much as a cached position (~6 us per column and step for the default model)."""

    def __init__(self, capacity: int = GROWTH) -> None:
        if capacity < 1:
            raise ValueError(f"a fixed cache needs room for at least one position, got {capacity}")
        self.capacity = capacity
        self.cache = Cache(layer_class_to_replicate=self._new_layer)
        self.length = 0
        self._columns: int | None = None  # set during an eager pass

    def _new_layer(self) -> FixedLayer:
        layer = FixedLayer(max_cache_len=self.capacity)
        layer.columns = self._columns  # a layer created by an eager pass (the first one) takes part in it
        return layer

    def __len__(self) -> int:
        return self.length

    def truncate(self, length: int) -> None:
        if length > self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} positions to {length}")
        for layer in self.cache.layers:
            layer.set_length(length)
        self.length = length

    def reserve(self, width: int) -> None:
        """Make room for a pass of ``width`` more tokens."""
        need = self.length + width
        if need <= self.capacity:
            return
        capacity = -(-need // GROWTH) * GROWTH
        for layer in self.cache.layers:
            layer.resize(capacity, self.length)
        self.capacity = capacity

    @contextmanager
    def eager(self, width: int):
        """An eager pass of ``width`` tokens: the layers give attention their first ``len + width`` columns only,
        not the whole buffer (a compiled graph needs the whole buffer; an eager pass would pay for it). The cache
        holds the ``width`` more positions when the pass completes."""
        self.reserve(width)
        for layer in self.cache.layers:
            layer.columns = self.length + width
        self._columns = self.length + width
        try:
            yield
        finally:
            for layer in self.cache.layers:
                layer.columns = None
            self._columns = None
        self.length += width

    def mask(self, width: int, dtype: torch.dtype, device: torch.device, config=None):
        """The additive attention mask of a causal pass of ``width`` tokens after the cached ones:
        ``[1, 1, width, columns]`` (all of the buffer, or what ``eager`` set), 0 where a token may attend, the
        dtype's minimum elsewhere; with the model's ``config``, as its layers take it (``masks.for_layers``: a
        model with sliding-window layers gets them a windowed copy). Columns are marked dynamic: one graph for all
        cache sizes."""
        columns = torch.arange(self._columns or self.capacity, device=device)
        positions = torch.arange(self.length, self.length + width, device=device)
        allowed = columns[None, :] <= positions[:, None]
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)
        mask = mask[None, None]
        if config is not None:
            mask = for_layers(config, mask, positions, columns)
        if isinstance(mask, dict):
            return {kind: _dynamic_columns(m, 3) for kind, m in mask.items()}
        return _dynamic_columns(mask, 3)

    def close(self) -> None:
        self.cache = Cache(layer_class_to_replicate=self._new_layer)
        self.length = 0


def _dynamic_columns(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """Tell the compiler that ``tensor``'s size along ``dim`` (a cache's capacity) varies: one graph for all."""
    torch._dynamo.maybe_mark_dynamic(tensor, dim)
    return tensor


def unpacked_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` sharing every parameter and buffer, with ``verispec.backends.hf.packing.PackedLinear`` layers turned
    back into ``nn.Linear`` (inductor packs the weights its own way)."""
    from .packing import PackedLinear

    memo = {id(t): t for t in (*model.parameters(), *model.buffers())}
    for module in model.modules():
        if isinstance(module, PackedLinear):
            memo[id(module._packed)] = module._packed
    shadow = copy.deepcopy(model, memo)
    for name, module in list(shadow.named_modules()):
        if isinstance(module, PackedLinear):
            linear = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None, device="meta")
            linear.weight = module.weight
            if module.bias is not None:
                linear.bias = module.bias
            parent_name, _, child = name.rpartition(".")
            setattr(shadow.get_submodule(parent_name) if parent_name else shadow, child, linear)
    return shadow


ONE_TOKEN_ATTENTION = "verispec_one_token_sdpa"


def one_token_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                        **kwargs) -> tuple[torch.Tensor, None]:
    """SDPA for one new token with grouped-query attention, without copying keys and values per query head.

    transformers' SDPA path repeats each KV head for its query heads (``repeat_kv``) when it is compiled with a
    mask: a copy of the whole cache per layer and step. With one token, the query heads that share a KV head can be
    laid out as that head's query rows instead (what transformers does eagerly, ``pack_gqa``), so SDPA reads each
    cached key and value once."""
    batch, heads, rows, dim = query.shape
    groups = heads // key.shape[1]
    if rows != 1 or groups == 1:  # not a one-token pass of a grouped model: transformers' own SDPA
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, dropout=dropout,
                                              scaling=scaling, **kwargs)
    out = nn.functional.scaled_dot_product_attention(query.reshape(batch, key.shape[1], groups, dim), key, value,
                                                     attn_mask=attention_mask, scale=scaling)
    return out.reshape(batch, heads, rows, dim).transpose(1, 2).contiguous(), None


AttentionInterface.register(ONE_TOKEN_ATTENTION, one_token_attention)


class CompiledStep:
    """The compiled one-token forward of a transformers causal LM over a ``FixedKV``."""

    def __init__(self, model: nn.Module) -> None:
        self.compile_seconds: float | None = None  # set by the first call (the compile)
        weight = next(model.parameters())
        self.dtype, self.device = weight.dtype, weight.device
        self._config = model.config
        shadow = unpacked_copy(model)
        shadow.set_attn_implementation(ONE_TOKEN_ATTENTION)
        self._model = torch.compile(shadow, dynamic=False, options={"max_autotune": True})

    def __call__(self, kv: FixedKV, token: int) -> torch.Tensor:
        """Run one token after ``kv``'s cached positions and cache it; returns its logits ``[1, vocab]``."""
        kv.reserve(1)
        t0 = time.perf_counter()
        # freezing folds the weights into the graph as constants; inductor reads it when it compiles, which is
        # during a call (the first, or one whose guards fail), and torch.compile's options do not pass it on
        with inductor_config.patch(freezing=True):
            out = self._model(input_ids=torch.tensor([[token]], device=self.device), cache=kv.cache,
                              position_ids=torch.tensor([[kv.length]], device=self.device),
                              attention_mask=kv.mask(1, self.dtype, self.device, self._config), use_cache=True)
        kv.length += 1
        if self.compile_seconds is None:
            self.compile_seconds = time.perf_counter() - t0
            log.info("compiled the one-token step in %.1f s", self.compile_seconds)
        return out.logits[0]
