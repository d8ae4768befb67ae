"""Every architecture family in the zoo (tests/zoo.py: Llama, Qwen2, Qwen3, Gemma 3 with sliding-window layers,
Mistral, Phi-3) through the transformers backend: the cache and its rollback against a forward with no cache, plain and
speculative greedy decoding (n-gram chains and trees, a draft model, lookahead, layer skipping) against greedy
decoding with no cache at all, and the batch engine; Gemma 3 also the fixed-buffer cache of the compiled step and the
exact sampled distribution (the others' graphs and sampling: below). Sequences run past the 6-token sliding windows of Gemma 3 (every other layer) and Mistral (every layer).
A rollback that skips one position fails every family."""

import json

import pytest
import torch

from statistical_helpers import ALPHA, joint_p_value
from tiny import loaded
from verispec import ModelDrafter, NgramDrafter, SamplingParams, SpeculativeDecoder
from verispec.backends.torch_cpu import compile_store
from verispec.backends.hf.compiled import FixedKV
from verispec.drafters.layerskip import LayerSkipDrafter
from verispec.drafters.lookahead import LookaheadDrafter
from zoo import ARCHITECTURES, assert_rollback_matches, batch_engine_outputs, make_zoo_model, zoo_target

FAMILIES = list(ARCHITECTURES)
PROMPT = [1, 5, 9, 7, 3, 5, 9, 7, 3, 11, 4]
NEW = 36


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def target(family):
    return zoo_target(family)


@torch.inference_mode()
def reference_greedy(model, prompt, n=NEW):
    """Greedy decoding with no cache at all: every token from a forward over the whole sequence."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@torch.inference_mode()
@pytest.mark.parametrize("kind", ["grow", "fixed"])
def test_cache_and_rollback_match_a_forward_with_no_cache(target, kind):
    tokens = PROMPT + [6, 8, 10, 12, 14, 16, 18, 20, 22, 24]
    whole = target.model(input_ids=torch.tensor([tokens])).logits[0]
    assert_rollback_matches(target, target.new_kv() if kind == "grow" else FixedKV(), tokens, whole)


@torch.inference_mode()
def test_tree_and_batched_passes_match_a_forward_with_no_cache(target):
    """The passes that take an explicit mask (trees, rows of a batch at their own positions), past the window."""
    tokens = PROMPT + [6, 8, 10, 12, 14, 16, 18, 20]
    whole = target.model(input_ids=torch.tensor([tokens])).logits[0]
    kv = target.new_kv()
    target.forward(kv, tokens[:14])
    # the pending token, then a tree whose first branch is the true continuation and a second a wrong one
    out = target.forward(kv, tokens[14:19] + [30, 29], parents=[-1, 0, 1, 2, -1, 4]).logits
    torch.testing.assert_close(out[:5], whole[14:19], atol=1e-4, rtol=1e-4)
    group = target.new_kv_group(3)
    rows = [group.new_kv() for _ in range(3)]
    target.forward_batch([(rows[0], tokens[:15]), (rows[1], tokens[:9]), (rows[2], tokens[:4])])
    passes = target.forward_batch([(rows[0], tokens[15:]), (rows[1], tokens[9:13]), (rows[2], tokens[4:5])])
    for got, start, n in zip(passes, (15, 9, 4), (len(tokens) - 15, 4, 1)):
        torch.testing.assert_close(got.logits, whole[start : start + n], atol=1e-4, rtol=1e-4)


def drafters(target, family):
    noisy = loaded(make_zoo_model(family, seed=0), target.tokenizer, name="noisy")
    with torch.no_grad():
        gen = torch.Generator().manual_seed(1)
        for prm in noisy.model.parameters():
            prm.add_(0.05 * torch.randn(prm.shape, generator=gen))
    return {"ngram": NgramDrafter(), "ngram-tree": NgramDrafter(branches=3), "model": ModelDrafter(noisy, target),
            "lookahead": LookaheadDrafter(3, 3, 3), "layerskip": LayerSkipDrafter(target, "2")}


def test_plain_and_speculative_greedy_output_is_greedy_decoding_with_no_cache(target, family):
    expected = reference_greedy(target.model, PROMPT)
    assert SpeculativeDecoder(target).generate(PROMPT, max_new_tokens=NEW).token_ids == expected
    drafted = 0
    for name, drafter in drafters(target, family).items():
        result = SpeculativeDecoder(target, drafter, k=4, k_policy="fixed").generate(PROMPT, max_new_tokens=NEW)
        assert result.token_ids == expected, name
        drafted += result.stats.accepted
    assert drafted > 0


def test_the_batch_engine_gives_each_sequence_its_lone_output(target):
    prompts = [PROMPT, PROMPT[3:], [1, 4, 4, 8, 15, 16, 23, 42 % 32], PROMPT[:5]]
    expected = [reference_greedy(target.model, p, 20) for p in prompts]
    assert batch_engine_outputs(target, prompts, 20) == expected


# Sampling's acceptance and residual draws are the engine's, the same for every family (tests/test_statistical.py
# checks them on the tiny Llama with every kind of drafter); what a family changes is its cache and what a rollback
# keeps, checked above for each. Gemma 3 runs the exact test too: its sliding-window layers (every other one) keep
# only the window's positions, the one cache here whose rollback could leave a sampled position a wrong context
# (each family's test costs 40-50 s on a loaded core).
SAMPLED = ["gemma3"]


@pytest.mark.parametrize("family", SAMPLED)
def test_sampled_output_follows_the_exact_joint_distribution(family):
    decoder = SpeculativeDecoder(zoo_target(family), NgramDrafter(), k=3, k_policy="fixed")
    assert joint_p_value(decoder, SamplingParams(temperature=1.0)) > ALPHA


# the family whose compiled graph differs most from the Llama graph that tests/test_compiled.py (tiny) and
# tests/test_e2e_compiled.py (SmolLM2) compile: Gemma 3's holds sliding-window masks beside full-attention layers, the
# fixed buffers' other kind of mask. Qwen2 adds only biases to the Llama graph, Mistral only a window (Gemma 3's kind),
# Qwen3 norms on q and k and Phi-3 fused projections: operations inside a layer that inductor compiles as any other,
# around the same fixed-buffer cache; each family's two programs cost 55-70 s to compile on a loaded core.
COMPILED = ["gemma3"]


@pytest.mark.parametrize("family", COMPILED)
def test_the_compiled_step_gives_greedy_decoding_with_no_cache(family, monkeypatch, tmp_path):
    # each family's graph compiled without autotuning its GEMMs (~45 s instead of ~2 min a family on 2 cores): what
    # differs between families is the graph (masks, windows, norms), not the kernel choice (the whole suite builds
    # without autotuning: tests/conftest.py)
    monkeypatch.setenv(compile_store.AUTOTUNE_ENV, "0")
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))  # compiled every run, never stored in the user's cache
    fast = zoo_target(family)
    assert fast.compile_step() is True
    assert json.loads(fast.step.path.with_suffix(".json").read_text())["key"]["options"]["max_autotune"] is False
    expected = reference_greedy(fast.model, PROMPT)
    assert SpeculativeDecoder(fast).generate(PROMPT, max_new_tokens=NEW).token_ids == expected
    assert fast.verify is not None  # the verify program compiles for every family too (sliding-window masks included)
    spec = SpeculativeDecoder(fast, NgramDrafter(), k=3, k_policy="fixed")  # compiled steps and compiled verify passes
    assert spec.generate(PROMPT, max_new_tokens=NEW).token_ids == expected
    trees = SpeculativeDecoder(fast, NgramDrafter(branches=3), k=4, k_policy="fixed")  # trees on the verify program
    assert trees.generate(PROMPT, max_new_tokens=NEW).token_ids == expected
    # the same step loaded again from the compile cache, after other families' steps were loaded in this process
    # (in another process the sliding-window masks came in another order, swapped, before they were sorted)
    again = zoo_target(family)
    assert again.compile_step(cached_only=True) is True and again.step.loaded
    again.wait_compiled()  # the stored verify program loads in the background
    assert again.verify is not None and again.verify.loaded
    assert SpeculativeDecoder(again).generate(PROMPT, max_new_tokens=NEW).token_ids == expected
    spec = SpeculativeDecoder(again, NgramDrafter(), k=3, k_policy="fixed")
    assert spec.generate(PROMPT, max_new_tokens=NEW).token_ids == expected
