"""A blocks model's whole pass with its decoder layers in one native call, without transformers' model loop.

Each decoder layer of a Llama / Qwen2 model on blocks already runs as one native call where its whole layer is served
(``block_step.NativeFront`` with ``back``). What a pass still spent in Python around those calls, for a small model
(docs/kernels.md, the default model's one-token pass), is the model's loop: transformers' model forward and its
decorators, a module call, ``LeanForward`` and ``NativeFront``'s checks and arguments for every layer. ``NativeStack``
runs the pass as transformers' causal LM does (the token embedding, the rotary tables, every decoder layer in order,
the final norm on the rows whose logits are kept, the output product) with the layers handed to ``_native.layers``
at once: each layer is the same routine with the same inputs as its own native call, so the same bits. It is used
(``BlocksModel``) where every decoder layer's whole layer runs natively and a probe at load gives transformers' own
forward's logits and cache bit for bit (``install``); it serves the passes the native layers serve (a sequence's
causal pass, a batch's rows, a token tree's nodes, on caches whose layers have ``slots``) and returns None for any
other (hidden states asked for, a mask without the rows' keys, ...), which then runs through transformers.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

from .. import blockmm
from ..blockmm import _native
from ..errors import InvalidRequest
from . import block_step
from .hf.row_attention import ROW_ATTENTION

log = logging.getLogger(__name__)

LAYER_FIELDS = 13  # _native.cpp's LAYER_FIELDS: norm1, norm2, desc, n_qkv, n_gu, kbuf, vbuf, kb, kh, ks, vb, vh, vs


class NativeStack:
    """``model``'s pass with its decoder layers in one native call (see the module). ``__call__`` takes the keyword
    arguments the blocks backend passes transformers' causal LM and returns its output (logits only), or None for a
    pass it does not serve."""

    def __init__(self, model: nn.Module, fronts: list) -> None:
        inner = model.model
        self.model = model
        self.layers = inner.layers  # a view of the model with other layers (layer skipping) is not served
        self.embed, self.rotary, self.norm = inner.embed_tokens, inner.rotary_emb, inner.norm
        self.head = model.get_output_embeddings()
        self.config = model.config
        self.fronts = fronts
        first = fronts[0]
        self._shape = first._shape  # hidden, heads, kv_heads, head_dim, eps: every layer's (``install`` checks)
        self._scale = first._scale
        # each layer's record (the native call's): the norms and product counts here, the rest written per pass into
        # a copy (passes on other threads, with other caches, may run at once)
        self._records = np.zeros((len(fronts), LAYER_FIELDS), dtype=np.int64)
        for i, front in enumerate(fronts):
            self._records[i, :5] = (front.norms[0].data_ptr(), front.norms[1].data_ptr(), 0, *front._runs)
        self._matrices = [matrix for front in fronts for matrix, _ in front._products]
        self._layouts: list[bool] | None = None  # the matrices' layouts the records' descriptors were read for
        self.passes = 0

    def _descriptors(self) -> None:
        """Each layer's products in its record: read again where a matrix's layout changed (``Matrix.packed``,
        toggled in place), and after ``forget`` (once the load has linked each matrix to the next)."""
        layouts = [matrix.packed for matrix in self._matrices]
        if layouts != self._layouts:
            for i, front in enumerate(self.fronts):
                self._records[i, 2] = front.descriptor().data_ptr()
            self._layouts = layouts

    def forget(self) -> None:
        """Read the layers' products again at the next pass."""
        for front in self.fronts:
            front.forget()
        self._layouts = None

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor | None = None, attention_mask=None, position_ids=None, cache=None,
                 use_cache: bool | None = None, logits_to_keep: int | torch.Tensor = 0,
                 output_hidden_states: bool = False, verispec_keys=None, **rest) -> CausalLMOutputWithPast | None:
        if (rest or output_hidden_states or input_ids is None or input_ids.dim() != 2 or not use_cache
                or self.model.model.layers is not self.layers or self.config._attn_implementation != ROW_ATTENTION):
            return None
        B, R = input_ids.shape
        if R == 0 or (verispec_keys is None and (attention_mask is not None or B != 1)):
            return None  # as block_step.NativeFront: the row attention hands such passes to SDPA
        caches = block_step.cache_layers(cache, len(self.fronts))
        if caches is None:
            return None
        x = self.embed(input_ids)
        if x.dtype != torch.float32 or not x.is_contiguous():
            return None
        if position_ids is None:
            past = cache.get_seq_length()
            position_ids = torch.arange(past, past + R)[None]
        cos, sin = self.rotary(x, position_ids)
        if cos.dtype != torch.float32 or not cos.is_contiguous() or not sin.is_contiguous():
            cos, sin = cos.float().contiguous(), sin.float().contiguous()
        like = torch.empty(B, self._shape[2], 0, self._shape[3])
        first, buffers = None, []
        for layer in caches:
            keys, values, starts, end = layer.slots(like, R)
            if first is None:
                first = (starts, end)
            elif (starts, end) != first:
                return None  # layers of unequal lengths: each layer's own call handles them
            buffers.append((keys.data_ptr(), values.data_ptr(), *keys.stride()[:3], *values.stride()[:3]))
        self._descriptors()
        fields = self._records.copy()
        fields[:, 5:] = buffers
        starts, counts, index = block_step.pass_layout(verispec_keys, B, R, *first)
        end = first[1]
        out = torch.empty_like(x)
        hidden, heads, kv_heads, head_dim, eps = self._shape
        _native.layers(
            x.data_ptr(), out.data_ptr(), B, R, hidden, heads, kv_heads, head_dim, eps, self._scale,
            fields.ctypes.data, len(self.fronts), cos.data_ptr(), sin.data_ptr(),
            0 if cos.shape[0] == 1 else R * head_dim, starts.data_ptr(), counts.data_ptr(),
            0 if index is None else index.data_ptr(), 0 if index is None else index.shape[2], blockmm.threads_now())
        for layer in caches:
            layer.filled(end)
        self.passes += 1
        if isinstance(logits_to_keep, int):  # transformers' slice: the last rows, or all for 0
            out = out[:, -logits_to_keep:] if logits_to_keep else out
        else:
            out = out[:, logits_to_keep]
        return CausalLMOutputWithPast(logits=self.head(self.norm(out)))


def install(model: nn.Module) -> NativeStack | None:
    """A ``NativeStack`` for ``model`` (after ``block_layers.install``) where every decoder layer runs its whole layer
    natively, all of one shape, and two probe passes (three tokens, then two after them) give transformers' forward's
    logits and cache bit for bit; else None. Call it before ``blockmm.link``: the layers' products are read again at
    the first pass."""
    from .block_layers import LeanForward
    from .hf.cache import new_cache
    from .hf.layers import decoder_layers

    try:
        layers = decoder_layers(model)
    except InvalidRequest:
        return None
    inner = model.model
    if not len(layers) or not all(hasattr(inner, n) for n in ("embed_tokens", "rotary_emb", "norm")):
        return None
    leans = [layer.__dict__.get("forward") for layer in layers]
    fronts = [lean.front if isinstance(lean, LeanForward) else None for lean in leans]
    if any(f is None or not f.back for f in fronts) or any(f.attn.layer_idx != i for i, f in enumerate(fronts)):
        return None
    if any((f._shape, f._scale) != (fronts[0]._shape, fronts[0]._scale) for f in fronts):
        return None
    stack = NativeStack(model, fronts)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, 5), generator=torch.Generator().manual_seed(0))
    own, native = new_cache(), new_cache()
    same = True
    with torch.inference_mode():
        for part in (ids[:, :3], ids[:, 3:]):
            want = model(input_ids=part, cache=own, use_cache=True)
            got = stack(input_ids=part, cache=native, use_cache=True)
            same = same and got is not None and torch.equal(want.logits, got.logits)
    same = same and all(torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
                        for a, b in zip(own.layers, native.layers))
    stack.forget()
    if not same:
        log.warning("the decoder layers' single native call does not give transformers' logits on a probe; each layer "
                    "runs as its own call")
        return None
    stack.passes = 0
    return stack
