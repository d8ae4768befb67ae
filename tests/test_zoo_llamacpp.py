"""The zoo's families (tests/zoo.py) through the llama.cpp backend, from F32 GGUF files that llama.cpp's own converter
writes from the tiny transformers models (with SmolLM2's vocabulary: the converter accepts only tokenizers it knows).
Each family: llama.cpp's logits equal the transformers model's (the file is that model), the cache and its rollback
equal a forward with no cache, batched passes equal lone ones, the batch engine gives each sequence its lone output,
and plain and speculative greedy decoding (n-gram chains, a draft model, suffix drafts) are one output. Sequences run
past the 6-token windows of Gemma 3's sliding layers; for Mistral, whose sliding window llama.cpp's llama
architecture does not apply, comparisons with transformers stay inside the window. A rollback one position off fails
every family."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import require_llama_cpp
from verispec import InvalidRequest, ModelDrafter, NgramDrafter, SpeculativeDecoder
from verispec.drafters import SuffixDrafter
from verispec.backends.references import DEFAULT_MODEL, resolve
from zoo import ARCHITECTURES, assert_rollback_matches, batch_engine_outputs, zoo_gguf

FAMILIES = list(ARCHITECTURES)
TOKENS = [1, 5, 9, 7, 3, 5, 9, 7, 3, 11, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24]
WINDOW_IGNORED = {"mistral"}  # llama.cpp runs Mistral's GGUF (llama architecture) with full attention
NEW = 30


@pytest.fixture(scope="module")
def tokenizer():
    require_llama_cpp()
    return AutoTokenizer.from_pretrained(str(resolve(DEFAULT_MODEL)))


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def pair(family, tokenizer, tmp_path_factory):
    """(the transformers model, the llama.cpp target loaded from its GGUF)."""
    from verispec.backends.llamacpp import LlamaCppModel

    folder = tmp_path_factory.mktemp("zoo") / family
    path = zoo_gguf(family, tokenizer, folder)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return reference, LlamaCppModel(path, tokenizer, f"tiny-{family}", sequences=4)


def compared(family) -> int:
    """How many leading positions llama.cpp and transformers must agree on."""
    return 6 if family in WINDOW_IGNORED else len(TOKENS)


@torch.inference_mode()
def test_the_gguf_is_the_model_and_rollback_matches_a_forward_with_no_cache(pair, family):
    reference, target = pair
    whole = reference(input_ids=torch.tensor([TOKENS])).logits[0]
    plain = target.forward(target.new_kv(), TOKENS).logits
    n = compared(family)
    # llama.cpp's CPU kernels round differently from torch's: on an AVX2-only AMD EPYC one Gemma 3 logit in a million
    # differed by 5.4e-3 (a clean-clone CI run, 2026-11-27), elsewhere all stayed under 5e-3
    torch.testing.assert_close(plain[:n], whole[:n], atol=1e-2, rtol=2e-3)
    assert_rollback_matches(target, target.new_kv(), TOKENS, plain)


@torch.inference_mode()
def test_batched_passes_match_lone_passes(pair):
    _, target = pair
    plain = target.forward(target.new_kv(), TOKENS).logits
    group = target.new_kv_group(3)
    rows = [group.new_kv() for _ in range(3)]
    target.forward_batch([(rows[0], TOKENS[:15]), (rows[1], TOKENS[:9]), (rows[2], TOKENS[:4])])
    passes = target.forward_batch([(rows[0], TOKENS[15:]), (rows[1], TOKENS[9:13]), (rows[2], TOKENS[4:5])])
    for got, start, n in zip(passes, (15, 9, 4), (len(TOKENS) - 15, 4, 1)):  # F32 rounding of other pass shapes
        torch.testing.assert_close(got.logits, plain[start : start + n], atol=1e-3, rtol=1e-3)


def test_speculative_greedy_output_is_plain_greedy_decoding(pair, family, tokenizer):
    from verispec.backends.llamacpp import LlamaCppModel

    reference, target = pair
    prompt = TOKENS[:11]
    expected = SpeculativeDecoder(target).generate(prompt, max_new_tokens=NEW).token_ids
    if family not in WINDOW_IGNORED:  # llama.cpp's greedy decoding is the transformers model's
        with torch.inference_mode():
            out = reference.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False,
                                     eos_token_id=None)
        assert expected == out[0, len(prompt):].tolist()[: len(expected)]
    draft = LlamaCppModel(target.path, tokenizer, f"tiny-{family}-draft", sequences=2)  # a second copy
    accepted = 0
    for name, drafter in {"ngram": NgramDrafter(), "model": ModelDrafter(draft, target),
                          "suffix": SuffixDrafter()}.items():
        got = SpeculativeDecoder(target, drafter, k=4, k_policy="fixed").generate(prompt, max_new_tokens=NEW)
        assert got.token_ids == expected, name
        accepted += got.stats.accepted
    assert accepted > 0


def test_the_batch_engine_gives_each_sequence_its_lone_output(pair):
    _, target = pair
    prompts = [TOKENS[:11], TOKENS[3:9], [1, 4, 4, 8, 15, 16, 23, 42], TOKENS[:5]]
    expected = [SpeculativeDecoder(target).generate(p, max_new_tokens=16).token_ids for p in prompts]
    assert batch_engine_outputs(target, prompts, 16) == expected


@torch.inference_mode()
def test_inner_hidden_states_come_as_layer_inputs_where_the_architecture_records_them(pair, family):
    """llama.cpp aborts the process (a GGML_ASSERT) when asked for the layer inputs of an architecture whose graph does
    not record them, so they are read only for those verified; elsewhere a model without the callback says so."""
    from verispec.backends.llamacpp_states import LayerInputs

    reference, target = pair
    assert (target._inputs is not None) == (target.architecture in LayerInputs.ARCHITECTURES)
    assert target.architecture == {"mistral": "llama"}.get(family, family)
    if target._inputs is None:
        with pytest.raises(InvalidRequest, match=f"this one is {target.architecture}.*features=True"):
            target.forward(target.new_kv(), TOKENS[:4], feature_layers=(1,))
        return
    layers = (0, 1, target.final_feature_layer)
    ref = reference(input_ids=torch.tensor([TOKENS[:6]]), output_hidden_states=True).hidden_states
    out = target.forward(target.new_kv(), TOKENS[:6], feature_layers=layers).hidden
    for j, i in enumerate(layers):
        torch.testing.assert_close(out[:, j], ref[i][0], atol=1e-4, rtol=1e-4)
