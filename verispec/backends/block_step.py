"""A decoder layer's attention half in one native call: the blocks backend's lean layers without the interpreter.

``LeanForward`` runs a layer as ~40 Python-level operations; between the kernel's products of a pass of 8 tokens they
cost ~11 ms of the 1.5B's ~72 (docs/kernels.md: the products and the attention are native, what is left is the
interpreter and torch's small operations). ``NativeFront`` hands the layer to one C++ routine
(``_native.layer_front``): the input norm, the q / k / v products and their biases, the rotary embedding, the new keys
and values written into the cache's buffers, the row attention, the output product and the residual, the second norm
and the gate / up products; and with ``back`` the MLP's rest: SiLU(gate) * up, ``down_proj`` and the last residual.
Each step is the routine the lean forward calls through Python, with the same inputs in the same order, so the bits
are the same; SiLU is torch's own arithmetic (``_native.silu_mul``: ATen's vectorized SiLU, SLEEF's expf, which
``silu_matches`` checks against ``F.silu`` once a process; rows a whole number of ``SILU_VECTOR`` floats, where torch
leaves no scalar tail). A probe at install (``block_layers.install``) checks the layer's output against
transformers' own, bit for bit, before the layer takes it.

It serves the passes the row attention serves (a sequence's causal pass, a batch's rows, a token tree's nodes) on
the caches that can say where a pass writes (``GrowingLayer``, ``RaggedLayer``: ``slots``); any other pass returns
``None`` and the lean forward runs it.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from .. import blockmm
from ..blockmm import _native
from .hf.row_attention import ROW_ATTENTION, _causal_counts, _layout

def _fields(matrix: blockmm.Matrix, bias: torch.Tensor | None) -> list[int]:
    """One product as the native call reads it (``_native.cpp``: ``PRODUCT_FIELDS``, in this order)."""
    kind, w, N, K, row_bytes = matrix._args
    next_w, next_n, next_row_bytes = matrix._next
    return [kind, w, N, K, row_bytes, int(matrix.packed), next_w, next_n, next_row_bytes,
            0 if bias is None else bias.data_ptr()]


class NativeFront:
    """The attention half of one decoder layer and its gate / up products (``LeanForward``'s ``lean``), natively.
    ``__call__`` returns ``(x2, gate, up)``, x2 the residual stream after the attention; with ``back`` the layer's
    output instead; or ``None`` for a pass it does not serve."""

    def __init__(self, lean, back: bool = False) -> None:
        layer = lean.layer
        attn = layer.self_attn
        self.lean, self.attn = lean, attn
        self.config = attn.config
        self.head_dim = lean.head_dim
        self.heads = attn.config.num_attention_heads
        self.kv_heads = attn.config.num_key_value_heads
        self.hidden = attn.config.hidden_size
        norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
        self.eps = norm1.eps  # both norms' (``usable`` checks)
        self.norms = (norm1.weight, norm2.weight)
        self.gate_up_sizes = [n for _, _, sizes in lean.gate_up.runs for n in sizes]
        o = attn.o_proj
        self._products = ([(m, b) for m, b, _ in lean.qkv.runs] + [(o._matrix, o.bias)]
                          + [(m, b) for m, b, _ in lean.gate_up.runs])  # in the native call's order
        self.back = back  # the MLP's rest natively too (``usable_back``)
        if back:
            down = layer.mlp.down_proj
            self._products.append((down._matrix, down.bias))
        self._shape = (self.hidden, self.heads, self.kv_heads, self.head_dim, self.eps)  # the call's fixed arguments
        self._runs = (len(lean.qkv.runs), len(lean.gate_up.runs))
        self._scale = float(attn.scaling)
        self._desc: tuple[tuple[bool, ...], torch.Tensor] | None = None
        self._empty: dict[int, torch.Tensor] = {}
        self.passes = 0  # passes served (install's probe checks that it served one)

    def descriptor(self) -> torch.Tensor:
        """The layer's products for the native call: read at the first pass (after the load has linked each matrix
        to the next) and again whenever a matrix's layout changed since (``Matrix.packed``, toggled in place)."""
        key = tuple(m.packed for m, _ in self._products)
        if self._desc is None or self._desc[0] != key:
            rows = [_fields(m, b) for m, b in self._products]
            self._desc = (key, torch.tensor(rows, dtype=torch.int64).reshape(-1))
        return self._desc[1]

    def forget(self) -> None:
        """Read the layer's products again at the next pass (after ``blockmm.link`` names each one's successor)."""
        self._desc = None
        self.passes = 0

    def __call__(self, x: torch.Tensor, attention_mask, cache, position_embeddings, kwargs: dict):
        if (cache is None or x.dtype != torch.float32 or x.dim() != 3 or not x.is_contiguous()
                or self.config._attn_implementation != ROW_ATTENTION or getattr(cache, "offloading", False)):
            return None
        B, R, _ = x.shape
        rows = kwargs.get("verispec_keys")
        if rows is None and (attention_mask is not None or B != 1):
            return None  # row_attention hands such passes to SDPA
        idx = self.attn.layer_idx
        layers = cache_layers(cache, idx + 1)
        if layers is None:
            return None
        layer_cache = layers[idx]
        like = self._empty.get(B)
        if like is None:
            like = self._empty[B] = torch.empty(B, self.kv_heads, 0, self.head_dim)
        keys, values, starts, end = layer_cache.slots(like, R)
        starts, counts, index = pass_layout(rows, B, R, starts, end)
        cos, sin = position_embeddings
        if cos.dtype != torch.float32 or not cos.is_contiguous() or not sin.is_contiguous():
            cos, sin = cos.float().contiguous(), sin.float().contiguous()
        desc = self.descriptor()
        if self.back:  # the native call keeps x2 and gate / up to itself
            out, x2, gu = torch.empty_like(x), None, None
        else:
            out, x2, gu = None, torch.empty_like(x), torch.empty(B, R, sum(self.gate_up_sizes), dtype=torch.float32)
        D = self.head_dim
        ks, vs = keys.stride(), values.stride()
        _native.layer_front(
            x.data_ptr(), B, R, *self._shape, self.norms[0].data_ptr(), self.norms[1].data_ptr(), desc.data_ptr(),
            *self._runs, cos.data_ptr(), sin.data_ptr(), 0 if cos.shape[0] == 1 else R * D, keys.data_ptr(),
            values.data_ptr(), ks[0], ks[1], ks[2], vs[0], vs[1], vs[2], starts.data_ptr(), counts.data_ptr(),
            0 if index is None else index.data_ptr(), 0 if index is None else index.shape[2], self._scale,
            blockmm.threads_now(), 0 if x2 is None else x2.data_ptr(), 0 if gu is None else gu.data_ptr(),
            0 if out is None else out.data_ptr())
        layer_cache.filled(end)
        self.passes += 1
        if out is not None:
            return out
        gate, up = gu.split(self.gate_up_sizes, -1)
        return x2, gate, up


def cache_layers(cache, n: int) -> list | None:
    """The cache's first ``n`` layers, made as transformers' ``Cache.update`` makes them, or None where one of them
    cannot say where a pass writes (no ``slots``)."""
    layers = getattr(cache, "layers", None)
    if layers is None or getattr(cache, "offloading", False):
        return None
    replicate = getattr(cache, "layer_class_to_replicate", None)
    if replicate is not None:
        while len(layers) < n:
            layers.append(replicate())
    if len(layers) < n or not all(hasattr(layer, "slots") for layer in layers[:n]):
        return None
    return layers[:n]


def pass_layout(rows, B: int, R: int, starts: list[int], end: int):
    """(starts [B] int32, counts [B, R], index or None) of a pass: laid out by the rows' keys (``RowKeys``), or a
    sequence's causal pass writing columns starts[0]..end-1 (the same for every layer of the pass)."""
    if rows is not None:
        counts, index = _layout(rows, B, R)
        return torch.tensor(starts, dtype=torch.int32), counts, index
    starts, counts = _causal(starts[0], end, R)
    return starts, counts, None


@functools.lru_cache(maxsize=512)
def _causal(start: int, end: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(starts [1], counts [1, rows]) of one sequence's causal pass writing columns start..end-1: built once and kept
    (every layer of a pass asks for the same; read-only)."""
    return torch.tensor([start], dtype=torch.int32), _causal_counts(end, rows)


def usable(layer: nn.Module, lean) -> bool:
    """Whether ``layer``'s lean forward can hand its attention half to the native call: the row attention on, its
    shapes (head_dim a multiple of 8, query heads a multiple of key / value heads), q / k / v products whose columns
    are q's, k's and v's in that order, one or two gate / up products, contiguous float32 norms and biases."""
    attn = layer.self_attn
    config = attn.config
    D = lean.head_dim
    heads, kv_heads = getattr(config, "num_attention_heads", 0), getattr(config, "num_key_value_heads", 0)
    if (config._attn_implementation != ROW_ATTENTION or not heads or not kv_heads or D % 8 or heads % kv_heads
            or not isinstance(getattr(attn, "scaling", None), float)):
        return False
    sizes = [n for _, _, s in lean.qkv.runs for n in s]
    if sizes != [heads * D, kv_heads * D, kv_heads * D] or not 1 <= len(lean.gate_up.runs) <= 2:
        return False
    norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
    biases = [b for _, b, _ in lean.qkv.runs + lean.gate_up.runs] + [attn.o_proj.bias]
    return (layer.input_layernorm.eps == layer.post_attention_layernorm.eps
            and all(t.dtype == torch.float32 and t.is_contiguous() for t in norms)
            and all(b is None or (b.dtype == torch.float32 and b.is_contiguous()) for b in biases))


SILU_VECTOR = 32  # floats torch's vectorized SiLU loop takes at a time on AVX-512 (16 lanes, unrolled twice)


def usable_back(layer: nn.Module, lean) -> bool:
    """Whether the native call can compute ``layer``'s MLP after gate / up too (``usable`` holding): gate and up of one
    width I (a whole number of ``SILU_VECTOR``, so torch computes every element's SiLU on its vectorized loop),
    ``down_proj`` a block product from I to the hidden width, and the native SiLU giving torch's bits on this machine
    (``silu_matches``)."""
    down = getattr(layer.mlp, "down_proj", None)
    sizes = [n for _, _, s in lean.gate_up.runs for n in s]
    return (len(sizes) == 2 and sizes[0] == sizes[1] and sizes[0] % SILU_VECTOR == 0
            and isinstance(getattr(down, "_matrix", None), blockmm.Matrix) and down.in_features == sizes[0]
            and down.out_features == layer.self_attn.config.hidden_size
            and (down.bias is None or (down.bias.dtype == torch.float32 and down.bias.is_contiguous()))
            and silu_matches())


_silu_checked: dict[str, bool] = {}  # per instruction set


def silu_matches() -> bool:
    """Whether ``_native.silu_mul`` gives ``F.silu(g) * u``'s bits here, on a sweep of values (every sign and exponent,
    and those around SiLU's cut-offs); checked once a process and instruction set."""
    key = blockmm.isa()
    if key not in _silu_checked:
        bits = torch.arange(0, 1 << 32, 65537, dtype=torch.int64).to(torch.int32).view(torch.float32)
        g = torch.cat([bits[torch.isfinite(bits)], torch.linspace(-110.0, 110.0, 4096)])
        g = g[: g.numel() // SILU_VECTOR * SILU_VECTOR].contiguous()
        u = torch.linspace(0.5, 2.0, g.numel())
        y = blockmm.silu_mul(g, u)
        # torch's reference in pieces below its parallel grain (32,768), each a whole number of vectors: split across
        # threads, its pieces' ends could fall mid-vector and take its scalar loop (std::exp)
        want = torch.cat([torch.nn.functional.silu(piece) for piece in g.split(8192)]) * u
        _silu_checked[key] = torch.equal(y, want)
    return _silu_checked[key]
