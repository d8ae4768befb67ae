"""Grouped-query attention without copied key/value heads, for the eager passes of a CPU model.

transformers' SDPA path (``sdpa_attention_forward``) repeats every key/value head for the query heads that share it
(``repeat_kv``) whenever a pass of several tokens carries a mask, which every verify pass over a cache, token tree and
batched pass does: a copy of the layer's whole cache, per layer and pass (the default model has 9 query heads on 3
key/value heads, so three times its cache). torch's SDPA takes grouped heads itself (``enable_gqa=True``) and reads
each cached key and value once; on CPU its rows are bitwise those of the repeated heads (tests/test_attention.py).
transformers uses it only without a mask, for the sake of GPU kernels that fall back to a slow path with one.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

GROUPED_SDPA = "verispec_grouped_sdpa"


def grouped_sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                 **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' SDPA, except that a masked pass of several tokens over grouped heads on CPU attends with SDPA's
    own grouped heads instead of repeated copies. ``query`` [batch, heads, rows, dim], ``key``/``value`` [batch,
    kv_heads, keys, dim]; returns [batch, rows, heads, dim] as transformers' attention functions do."""
    grouped = query.shape[1] != key.shape[1]
    if (not grouped or query.shape[2] == 1 or attention_mask is None or query.device.type != "cpu"
            or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None
            or kwargs.get("output_attentions")):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    out = nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                                     scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(GROUPED_SDPA, grouped_sdpa)
# the masks SDPA gets (an attention name without a registered mask function gets none, and a pass over a cache would
# then attend as if it started the sequence)
AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)


def use_grouped_sdpa(model: nn.Module) -> bool:
    """Switch a CPU model that runs transformers' SDPA to ``grouped_sdpa``; returns whether it applied (other attention
    implementations, e.g. the width-invariant one, and other devices are left alone)."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa" or next(model.parameters()).device.type != "cpu":
        return False
    model.set_attn_implementation(GROUPED_SDPA)
    return True
