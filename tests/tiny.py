"""Tiny random Llama models and a word-level tokenizer for fast, exact unit tests."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from verispec.backends.hf import LoadedModel

VOCAB = 32
EOS = 2


def make_tokenizer(vocab: int = VOCAB, rename: dict[int, str] | None = None) -> PreTrainedTokenizerFast:
    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(3, vocab)]
    for i, w in (rename or {}).items():
        words[i] = w
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def make_model(seed: int = 0, vocab: int = VOCAB, scale: float = 0.3, layers: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=scale, bos_token_id=1,
        eos_token_id=EOS, pad_token_id=0, tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).eval()


def noisy_copy(model: LlamaForCausalLM, noise: float, seed: int = 1) -> LlamaForCausalLM:
    """The same network with Gaussian noise on every weight: a draft that agrees often but not always."""
    gen = torch.Generator().manual_seed(seed)
    copy = LlamaForCausalLM(model.config).eval()
    copy.load_state_dict(model.state_dict())
    with torch.no_grad():
        for prm in copy.parameters():
            prm.add_(noise * torch.randn(prm.shape, generator=gen))
    return copy


def loaded(model, tokenizer=None, name="tiny", eos: frozenset[int] | None = frozenset()) -> LoadedModel:
    """Wrap as a LoadedModel; by default with no EOS so that generations run to max_new_tokens."""
    return LoadedModel(model=model, tokenizer=tokenizer or make_tokenizer(model.config.vocab_size), name=name,
                       eos_token_ids=eos)


def ancestors(parents: list[int], node: int) -> list[int]:
    """The nodes from a token tree's root down to ``node``, itself included (``parents[i]`` = -1 at the root)."""
    found = []
    while node >= 0:
        found.append(node)
        node = parents[node]
    return found[::-1]


def assert_draft_cache_is_a_fresh_pass(drafter, draft: LoadedModel) -> None:
    """A model drafter's cache holds exactly the tokens it lists (``_cached``), with the keys a fresh pass gives."""
    from transformers import DynamicCache

    assert len(drafter._cache) == len(drafter._cached)
    fresh = DynamicCache()
    with torch.no_grad():
        draft.model(torch.tensor([drafter._cached]), cache=fresh, use_cache=True)
    for mine, ref in zip(drafter._cache.cache.layers, fresh.layers):
        torch.testing.assert_close(mine.keys, ref.keys, atol=1e-5, rtol=1e-4)
