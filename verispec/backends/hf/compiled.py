"""The compiled decoder passes (AOTInductor), over a KV cache of fixed buffers with rollback.

On CPU a one-token step is bound by streaming the weights, and an eager step spends much of its time in Python and
small ops around the linears. The step is exported (``torch.export``, with the cache's size dynamic: one program
for every length) and compiled ahead of time by AOTInductor with frozen weights and ``max_autotune``: inductor's
C++ GEMM kernels over weights it packs once, the norms, rotary and attention fused around them, and a C++ wrapper
that calls them, so no Python runs per layer. What it buys per CPU: docs/kernels.md. Verify
passes of 2-12 tokens run a second program of the same kind whose width is dynamic too (``VERIFY_WIDTHS``: past
them the compiled pass no longer beats the eager one, docs/kernels.md). Token trees of 2-12 tokens run it too (positions and mask
are its inputs). Prefills and wider passes stay eager over the same cache; all are checked against a fresh
forward over the whole sequence in tests/test_compiled.py and tests/test_e2e_compiled.py.

Compiling takes about two minutes a program for the default model on 2 cores, so both are stored on disk
(``verispec.backends.torch_cpu.compile_store``, keyed by the weights, widths, CPU and software) and a later process loads
them in seconds; ``LoadedModel.compile_step`` loads or builds them before the first request.

The cache is transformers' ``StaticLayer`` with a length that can be set back (``FixedLayer``): every pass writes
at the sequence's length and attends through an explicit mask that hides the columns past each token's position,
so rolled-back positions are never read and the next pass overwrites them. The compiled step attends over the
whole buffer (its size is the program's dynamic dimension); the buffer grows in steps of ``GROWTH``. Eager passes
attend over the columns they need only. The compiled step attends through ``one_token_attention``, which reads each
KV head once.
"""

from __future__ import annotations

import copy
import logging
import time
import warnings
from contextlib import contextmanager

import torch
from torch import nn
from transformers import AttentionInterface, Cache, StaticLayer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ...tree import tree_inputs
from .cache import compact
from .masks import for_layers

log = logging.getLogger(__name__)

GROWTH = 256  # a cache's capacity is a multiple of this many positions: the fewest that hold its sequence


class FixedLayer(StaticLayer):
    """A ``StaticLayer`` that writes at its ``cumulative_length`` and can be set back to any shorter length.

    Its buffers are plain tensors that the compiled step takes as inputs (and writes in place). An eager pass sets ``columns`` to attend over the positions it needs only
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
        self.keys = key_like.new_zeros((self.batch_size, self.num_heads, capacity, self.k_head_dim))
        self.values = value_like.new_zeros((self.batch_size, self.num_heads, capacity, self.v_head_dim))

    def set_length(self, length: int) -> None:
        self.cumulative_length.fill_(length)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        if self.columns is None:  # a compiled pass: the whole buffer (its size is the program's dynamic dimension)
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
    keeps_positions = True  # keep(start, positions) moves a tree's accepted path (KVCache)

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
        model with sliding-window layers gets them a windowed copy)."""
        columns = torch.arange(self._columns or self.capacity, device=device)
        positions = torch.arange(self.length, self.length + width, device=device)
        allowed = columns[None, :] <= positions[:, None]
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)
        mask = mask[None, None]
        if config is not None:
            mask = for_layers(config, mask, positions, columns)
        return mask

    def keep(self, start: int, positions: list[int]) -> None:
        """Keep the first ``start`` positions and then ``positions`` (ascending, each >= ``start``), drop the rest."""
        compact(self.cache, start, positions)
        self.truncate(start + len(positions))

    def tree_mask(self, fed: int, parents: list[int], dtype: torch.dtype, device: torch.device, config=None):
        """(position ids ``[1, fed + nodes]``, mask ``[1, 1, fed + nodes, columns]``) of a pass that feeds ``fed``
        tokens and then a token tree (``verispec.tree.tree_inputs``) after the cached ones, over all of the buffer:
        the columns past the pass are hidden like the stale ones ``mask`` hides."""
        past, width = self.length, fed + len(parents)
        positions, tree = tree_inputs(past, fed, list(parents), dtype, device)
        columns = self._columns or self.capacity
        mask = tree.new_full((1, 1, width, columns), torch.finfo(dtype).min)
        mask[..., : past + width] = tree
        if config is not None:
            keys = torch.cat([torch.arange(past, device=device), positions[0],
                              torch.arange(past + width, columns, device=device)])
            mask = for_layers(config, mask, positions[0], keys)
        return positions, mask

    def close(self) -> None:
        self.cache = Cache(layer_class_to_replicate=self._new_layer)
        self.length = 0


def unpacked_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` sharing every parameter and buffer, with ``verispec.backends.torch_cpu.packing.PackedLinear`` layers turned
    back into ``nn.Linear`` (inductor packs the weights its own way)."""
    from ..torch_cpu.packing import PackedLinear

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


class StepModule(nn.Module):
    """A forward as a function of tensors only (what ``torch.export`` takes): the tokens, their positions,
    the attention mask (one tensor, or one per kind of layer for sliding-window models), the sequence's length and
    every layer's key and value buffers, which the pass writes in place. Returns the logits ``[1, n, vocab]`` and
    every layer's hidden state ``[layers + 1, 1, n, hidden]`` (the embeddings first), for drafters that read them
    (EAGLE): computed anyway, they cost one small copy, and one program serves every drafter."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, position_ids, mask, length, keys, values):
        layers = []
        for k, v in zip(keys, values):
            layer = FixedLayer(max_cache_len=k.shape[2])
            layer.keys, layer.values, layer.cumulative_length = k, v, length.clone()  # each layer advances its own
            layer.dtype, layer.device, layer.is_initialized = k.dtype, k.device, True
            layer.batch_size, layer.num_heads, layer.k_head_dim, layer.v_head_dim = *k.shape[:2], k.shape[3], v.shape[3]
            layers.append(layer)
        cache = Cache(layers=layers)
        out = self.model(input_ids=input_ids, cache=cache, position_ids=position_ids, attention_mask=mask,
                         use_cache=True, output_hidden_states=True)
        return out.logits, torch.stack(out.hidden_states)


VERIFY_WIDTHS = (2, 12)  # the verify program's pass widths (wider passes run eagerly: compiled, 16 cost more)


class CompiledStep:
    """A forward of a transformers causal LM over a ``FixedKV``, compiled ahead of time by AOTInductor (its C++
    wrapper calls the kernels: no Python per layer) and kept on disk (``compile_store``): the first process compiles
    it, later ones load it in seconds. ``widths`` (lowest, highest) are the pass widths it runs: (1, 1) for the
    one-token step; ``VERIFY_WIDTHS`` for the verify program, one program whose width is dynamic. ``build`` makes one
    (or loads it)."""

    def __init__(self, runner, model: nn.Module, seconds: float, loaded: bool, path,
                 widths: tuple[int, int] = (1, 1)) -> None:
        self._runner = runner
        self.path = path  # the package on disk
        weight = next(model.parameters())
        self.dtype, self.device = weight.dtype, weight.device
        self._config = model.config
        self.seconds = seconds  # to compile (or to load, when ``loaded``)
        self.loaded = loaded  # True: read from the compile cache on disk
        self.widths = widths

    @property
    def what(self) -> str:
        lowest, highest = self.widths
        return "the one-token step" if highest == 1 else f"verify passes of {lowest}-{highest} tokens"

    @classmethod
    def build(cls, model: nn.Module, name: str = "", *, cached_only: bool = False,
              widths: tuple[int, int] = (1, 1)) -> "CompiledStep | None":
        """The compiled pass of ``model`` for ``widths``: loaded from the compile cache, else compiled now (about two
        minutes each for the default model on 2 cores) and stored there; with ``cached_only`` None when it is not
        on disk. Raises what the compiler raises (``LoadedModel.compile_step`` turns that into a warning and eager
        decoding)."""
        from ..torch_cpu import compile_store

        shadow = unpacked_copy(model)
        shadow.set_attn_implementation(ONE_TOKEN_ATTENTION)
        width = 1 if widths == (1, 1) else f"{widths[0]}-{widths[1]}"
        key = compile_store.package_key(shadow, width, compile_store.source_of(StepModule, FixedLayer, _export,
                                                                               one_token_attention, for_layers))
        path = compile_store.package_path(key)
        t0 = time.perf_counter()
        runner = compile_store.load(path)
        if runner is not None:
            return cls(runner, model, time.perf_counter() - t0, loaded=True, path=path, widths=widths)
        if cached_only:
            return None
        missing = compile_store.compiler_missing()
        if missing:
            raise RuntimeError(missing)
        from ..steps import step

        pending = cls(None, model, 0.0, loaded=False, path=path, widths=widths)
        size = sum(t.numel() * t.element_size() for t in shadow.state_dict().values())
        with step(f"compiling {pending.what} of {name or 'the model'} (once per model and machine)",
                  f"compile-{'step' if width == 1 else 'verify'}", size):
            exported = _export(shadow) if width == 1 else _export(shadow, widths=widths)
            compile_store.save(exported, path, key, name)
        runner = compile_store.load(path)
        if runner is None:
            raise RuntimeError(f"the compiled pass written to {path} does not load")
        return cls(runner, model, time.perf_counter() - t0, loaded=False, path=path, widths=widths)

    def __call__(self, kv: FixedKV, tokens: list[int], parents: list[int] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run ``tokens`` (as many as ``widths`` allows) after ``kv``'s cached positions and cache them; returns their
        logits ``[n, vocab]`` and every layer's hidden state ``[layers + 1, 1, n, hidden]`` (index it as
        transformers' ``hidden_states``). With ``parents`` the last ``len(parents)`` tokens are a token tree
        (``verispec.tree``): the program takes positions and a mask as inputs, so a tree runs it as a chain does."""
        n = len(tokens)
        if not self.widths[0] <= n <= self.widths[1]:
            raise ValueError(f"{self.what} cannot run a pass of {n} tokens")
        kv.reserve(n)
        layers = kv.cache.layers
        if parents is None:
            positions = torch.arange(kv.length, kv.length + n, device=self.device)[None]
            mask = kv.mask(n, self.dtype, self.device, self._config)
        else:
            positions, mask = kv.tree_mask(n - len(parents), parents, self.dtype, self.device, self._config)
        logits, hidden = self._runner(torch.tensor([list(tokens)], device=self.device), positions, mask,
                                      torch.tensor(kv.length, device=self.device),
                                      [layer.keys for layer in layers], [layer.values for layer in layers])
        kv.length += n
        for layer in layers:
            layer.set_length(kv.length)
        return logits[0], hidden


def _export(shadow: nn.Module, width: int = 1, widths: tuple[int, int] | None = None, example: int = 4):
    """``torch.export`` of a pass of ``width`` tokens (the one-token step by default) with the cache's size (columns)
    dynamic: one program for every length; with ``widths`` (lowest, highest) the pass width is dynamic too, one
    program for every verify pass in that range, exported at the width in the range nearest ``example`` (4 or 8
    measured the same). ``experiments/compiled_width.py`` exports other widths and dtypes with it."""
    config = shadow.config
    kv = FixedKV(capacity=3 * GROWTH)
    # lay out the buffers with an eager pass of two tokens (no_grad, not inference mode: export writes into them)
    with torch.no_grad():
        shadow(input_ids=torch.tensor([[1, 2]]), cache=kv.cache, use_cache=True)
    kv.length = 2
    layers = kv.cache.layers
    keys, values = [layer.keys for layer in layers], [layer.values for layer in layers]
    if widths is not None:  # an example width inside the range that is neither 0 nor 1 (export specializes those)
        width = max(widths[0], min(widths[1], max(example, 2)))
    mask = kv.mask(width, keys[0].dtype, keys[0].device, config)
    columns = torch.export.Dim("columns", min=2, max=1 << 20)
    rows = None if widths is None else torch.export.Dim("width", min=widths[0], max=widths[1])
    mask_shape = {2: rows, 3: columns} if rows is not None else {3: columns}
    mask_shape = {kind: mask_shape for kind in mask} if isinstance(mask, dict) else mask_shape
    args = (torch.arange(3, 3 + width)[None], torch.arange(2, 2 + width)[None], mask, torch.tensor(2), keys, values)
    token_shape = None if rows is None else {1: rows}
    shapes = {"input_ids": token_shape, "position_ids": token_shape, "mask": mask_shape, "length": None,
              "keys": [{2: columns}] * len(keys), "values": [{2: columns}] * len(values)}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch's own pytree deprecations, not ours to fix
        return torch.export.export(StepModule(shadow).eval(), args, dynamic_shapes=shapes, strict=False)
