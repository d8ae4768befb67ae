"""The blocks backend's decoder layers: transformers' Llama / Qwen2 layer forward, the same operations in fewer calls.

A one-token pass of the 1.5B on blocks spent ~16 of its ~57 ms outside the kernel (docs/kernels.md): transformers'
Python, module calls and ~35 small torch operations a layer. ``LeanForward`` replaces a decoder layer's ``forward``
(the module, its hooks and its weights stay) with one function that runs

- q, k and v as one product, and gate and up as one, where the file stores them in one block type: their rows lie
  side by side in the weight buffer (``fusable``), so the joined matrix is a view, not a copy; each output column is
  the same arithmetic on the same row whether alone or joined, so the values are the same bits;
- the rotary embedding as one native call (``blockmm.rope``: transformers' ``q * cos + rotate_half(q) * sin``, the
  same IEEE operations in the same order);
- the cache update and the attention function exactly as transformers calls them;
- and, where the row attention serves the pass, everything from the input norm to the gate / up products as one
  native call (``block_step.NativeFront``), leaving SiLU, the product by ``up``, ``down_proj`` and the last residual.

It is installed only where it gives transformers' own layer's output bit for bit on a probe (``install``): another
family's layer, or a transformers release whose layer computes something else, keeps its own forward.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.nn import functional as F
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .. import blockmm
from . import block_step
from ..errors import InvalidRequest
from .block_modules import BlockLinear, RowRMSNorm

log = logging.getLogger(__name__)

JOINED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # sibling products that read the same input


def fusable(parent: nn.Module, name: str) -> tuple[str, ...] | None:
    """The sibling group ``name`` belongs to in ``parent`` (a module holding all of its members), or None."""
    for group in JOINED:
        if name in group and all(isinstance(getattr(parent, n, None), nn.Linear) for n in group):
            return group
    return None


class Products:
    """Some of a module's ``BlockLinear`` children computed together: runs of neighbours in one block type whose
    blocks lie one after another in memory become one ``blockmm.Matrix`` over the joined rows (a view), the rest stay
    alone. ``__call__(x)`` returns each child's output in order, bias added."""

    def __init__(self, linears: list[nn.Module]):
        self.runs: list[tuple[blockmm.Matrix, torch.Tensor | None, list[int]]] = []
        run: list[nn.Module] = []
        for linear in linears + [None]:
            if run and (linear is None or not _follows(run[-1], linear)):
                self.runs.append(_joined(run))
                run = []
            if linear is not None:
                run.append(linear)

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        outs = []
        for matrix, bias, sizes in self.runs:
            y = matrix(x)
            if bias is not None:
                y.add_(bias)
            outs.extend(y.split(sizes, -1) if len(sizes) > 1 else (y,))
        return outs


def _follows(a, b) -> bool:
    return (a.kind == b.kind and a.in_features == b.in_features and a.blocks.shape[1] == b.blocks.shape[1]
            and a.packed == b.packed and a.blocks.data_ptr() + a.blocks.numel() == b.blocks.data_ptr())


def _joined(run: list) -> tuple[blockmm.Matrix, torch.Tensor | None, list[int]]:
    first = run[0]
    rows = sum(m.out_features for m in run)
    blocks = torch.as_strided(first.blocks, (rows, first.blocks.shape[1]), (first.blocks.shape[1], 1))
    biases = [m.bias for m in run]
    if all(b is None for b in biases):
        bias = None
    else:
        bias = torch.cat([b.detach() if b is not None else torch.zeros(m.out_features)
                          for b, m in zip(biases, run)]).contiguous()
    matrix = blockmm.Matrix(blocks, first.kind, first.in_features, packed=first.packed)
    return matrix, bias, [m.out_features for m in run]


class LeanForward:
    """A Llama / Qwen2 decoder layer's forward (pre-norm attention and gated MLP) in fewer calls; see the module."""

    def __init__(self, layer: nn.Module):
        attn, mlp = layer.self_attn, layer.mlp
        self.layer = layer
        self.qkv = Products([attn.q_proj, attn.k_proj, attn.v_proj])
        self.gate_up = Products([mlp.gate_proj, mlp.up_proj])
        self.head_dim = attn.head_dim
        self.front = None  # the attention half in one native call (block_step.NativeFront), where install put it

    def __call__(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None, cache=None, use_cache: bool | None = False,
                 position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, **kwargs) -> torch.Tensor:
        layer = self.layer
        attn, mlp = layer.self_attn, layer.mlp
        if self.front is not None:
            front = self.front(hidden_states, attention_mask, cache, position_embeddings,
                               dict(kwargs, position_ids=position_ids, use_cache=use_cache))
            if isinstance(front, torch.Tensor):  # the whole layer (the front's ``back``)
                return front
            if front is not None:
                x2, gate, up = front
                return x2 + mlp.down_proj(F.silu(gate) * up)
        shape = hidden_states.shape[:-1]
        h = layer.input_layernorm(hidden_states)
        q, k, v = self.qkv(h)
        q = q.view(*shape, -1, self.head_dim).transpose(1, 2)
        k = k.view(*shape, -1, self.head_dim).transpose(1, 2)
        v = v.view(*shape, -1, self.head_dim).transpose(1, 2)
        cos, sin = position_embeddings
        q, k = blockmm.rope(q, cos, sin), blockmm.rope(k, cos, sin)
        kwargs = dict(kwargs, position_ids=position_ids, use_cache=use_cache)
        if cache is not None:
            k, v = cache.update(k, v, attn.layer_idx, kwargs=kwargs)
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, None)
        out, _ = attention(attn, q, k, v, attention_mask, dropout=0.0, scaling=attn.scaling,
                           sliding_window=getattr(attn, "sliding_window", None), **kwargs)
        hidden_states = hidden_states + attn.o_proj(out.reshape(*shape, -1))
        gate, up = self.gate_up(layer.post_attention_layernorm(hidden_states))
        return hidden_states + mlp.down_proj(F.silu(gate) * up)


def _shaped(layer: nn.Module) -> bool:
    """Whether ``layer`` has the parts ``LeanForward`` uses, each of the kind it expects."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if attn is None or mlp is None:
        return False
    linears = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")] + \
        [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    norms = [getattr(layer, n, None) for n in ("input_layernorm", "post_attention_layernorm")]
    return (all(isinstance(m, BlockLinear) for m in linears) and all(isinstance(n, RowRMSNorm) for n in norms)
            and isinstance(getattr(attn, "head_dim", None), int))  # the activation: SiLU, told by the probe


@torch.inference_mode()
def install(model: nn.Module) -> int:
    """Give each decoder layer of ``model`` a ``LeanForward`` where it computes transformers' layer bit for bit on a
    probe (two rows after three cached ones); returns how many layers have one."""
    from .hf.cache import new_cache
    from .hf.layers import decoder_layers

    try:
        layers = decoder_layers(model)
    except InvalidRequest:  # a model without model.model.layers keeps its own forwards
        return 0
    rotary = getattr(model.model, "rotary_emb", None)
    if rotary is None:
        return 0
    installed = 0
    probe = torch.Generator().manual_seed(0)
    for layer in layers:
        if not _shaped(layer):
            continue
        lean = LeanForward(layer)
        width = model.config.hidden_size
        past, new = torch.randn(1, 3, width, generator=probe), torch.randn(1, 2, width, generator=probe)

        def run(forward):
            cache = new_cache()
            for x, start in ((past, 0), (new, 3)):
                positions = torch.arange(start, start + x.shape[1])[None]
                y = forward(x, attention_mask=None, position_ids=positions, cache=cache, use_cache=True,
                            position_embeddings=rotary(x, positions))
            return y[0] if isinstance(y, tuple) else y

        own = run(type(layer).forward.__get__(layer))
        if not torch.equal(own, run(lean)):
            continue
        if block_step.usable(layer, lean):  # the attention half natively (and the MLP's rest), where the same bits
            for back in (True, False):
                if back and not block_step.usable_back(layer, lean):
                    continue
                lean.front = block_step.NativeFront(lean, back=back)
                if torch.equal(own, run(lean)) and lean.front.passes == 2:
                    lean.front.forget()  # its products are read again at the first pass, after the load links them
                    break
                lean.front = None
        layer.forward = lean
        installed += 1
    return installed


def native_fronts(model: nn.Module) -> tuple[int, int]:
    """How many of ``model``'s decoder layers run their attention half as one native call (``install``), and how many
    of those their whole layer (the MLP's rest too)."""
    fronts = [m.__dict__["forward"].front for m in model.modules() if isinstance(m.__dict__.get("forward"), LeanForward)]
    fronts = [f for f in fronts if f is not None]
    return len(fronts), sum(1 for f in fronts if f.back)
