"""Tiny random-weight models of the architecture families users bring (no download): their configs carry what
differs between families (sliding-window layers, QK norms, tied embeddings, soft-capped logits, fused projections,
attention biases), so a feature that works on Llama alone fails here."""

from __future__ import annotations

import torch
import transformers

from tiny import EOS, VOCAB, loaded

COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.3, bos_token_id=1,
              eos_token_id=EOS, pad_token_id=0)

# family -> (config class, model class, what sets it apart)
ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),  # q/k/v biases, tied embeddings
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=8, tie_word_embeddings=True)),  # QK norms
    # sliding-window layers (window 6, every other layer), soft-capped logits, scaled embeddings, tied embeddings
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(head_dim=8, sliding_window=6, final_logit_softcapping=5.0, query_pre_attn_scalar=8,
                    layer_types=["sliding_attention", "full_attention"] * 2)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=6, tie_word_embeddings=False)),  # every layer slides
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(tie_word_embeddings=False)),  # fused qkv and gate_up projections
}


def make_zoo_model(family: str, seed: int = 0) -> torch.nn.Module:
    config_class, model_class, extra = ARCHITECTURES[family]
    config = getattr(transformers, config_class)(**{**COMMON, **extra})
    torch.manual_seed(seed)
    return getattr(transformers, model_class)(config).eval()


def zoo_target(family: str, seed: int = 0):
    return loaded(make_zoo_model(family, seed), name=f"tiny-{family}")
