"""End-to-end on the real default model, whatever this CPU supports: bfloat16 with every drafter (packed kernels
where the CPU has them, the plain op elsewhere), the audit in bfloat16, and greedy output with prepacked float32
weights against transformers' own generate on plain weights. Marked e2e; run in CI."""

import pytest
import torch

from verispec import EagleDrafter, ModelDrafter, NgramDrafter, SpeculativeDecoder, load_model
from verispec.audit import run_audit
from verispec.batching import generate_batch
from verispec.cli import DEFAULT_AUDIT_PROMPT
from verispec.backends.torch_cpu.packing import packing_available

pytestmark = pytest.mark.e2e

PROMPT = "Rewrite this sentence in the passive voice: The committee approved the new budget on Monday."
# the prompts of test_e2e_default_model.py: short chat answers of several kinds
PROMPTS = [
    PROMPT,
    "Correct the spelling in this text and return it: Teh quick brown fox jumpd over the lazzy dog.",
    "Extract the names of the people from this text: Maria met John and Aisha at the station in Lyon.",
    "Write a short poem about the sea.",
    "What is the capital of France? Answer in one sentence.",
]


@pytest.fixture(scope="module")
def bf16_model():
    return load_model("smollm2-135m", dtype="bfloat16")


def test_bfloat16_loads_with_the_kernel_this_cpu_supports(bf16_model):
    assert bf16_model.model.dtype == torch.bfloat16
    assert (bf16_model.packed_layers > 0) == packing_available(torch.bfloat16)
    packed = packing_available(torch.bfloat16)
    assert bf16_model.width_invariant == packed
    assert bf16_model.linear_kernel == ("oneDNN-packed; width-invariant attention" if packed else "F.linear (oneDNN)")


@pytest.fixture(scope="module")
def bf16_plain(bf16_model):
    """bfloat16 plain decoding's greedy answers to PROMPTS, 64 tokens each."""
    if not bf16_model.width_invariant:
        pytest.skip("this CPU cannot run oneDNN's packed bfloat16 kernel: bfloat16 passes keep SDPA")
    plain = SpeculativeDecoder(bf16_model, None)
    return [plain.generate(prompt, max_new_tokens=64).token_ids for prompt in PROMPTS]


@pytest.mark.parametrize("drafter", ["ngram", "eagle", "eagle-tree"])
def test_bfloat16_greedy_speculation_equals_bfloat16_plain_decoding(bf16_model, bf16_plain, drafter):
    """Width-invariant passes (verispec.backends.hf.invariant): every greedy answer token-identical in bfloat16,
    chains and token trees, where this CPU runs packed bfloat16 linears (elsewhere identity is not promised in
    bfloat16)."""
    make = {"ngram": NgramDrafter, "eagle": lambda: EagleDrafter(bf16_model),
            "eagle-tree": lambda: EagleDrafter(bf16_model, tree=True)}
    spec = SpeculativeDecoder(bf16_model, make[drafter](), k=12 if drafter == "eagle-tree" else 6, k_policy="fixed")
    accepted = 0
    for prompt, expected in zip(PROMPTS, bf16_plain):
        out = spec.generate(prompt, max_new_tokens=64)
        assert out.token_ids == expected, prompt
        accepted += out.stats.accepted
    assert accepted > 0


def test_bfloat16_batched_greedy_speculation_equals_bfloat16_plain_decoding(bf16_model, bf16_plain):
    """Rows of a batched pass attend as each sequence alone would: the batch engine's answers equal plain
    decoding's too, with and without drafts."""
    for drafter in (None, NgramDrafter):
        decoders = [SpeculativeDecoder(bf16_model, drafter and drafter(), k=6, k_policy="fixed") for _ in PROMPTS]
        out = generate_batch(decoders, PROMPTS, max_batch=len(PROMPTS), max_new_tokens=64)
        assert [g.token_ids for g in out] == bf16_plain, drafter


@pytest.mark.parametrize("drafter", ["none", "ngram", "model", "eagle", "eagle-tree"])
def test_bfloat16_runs_with_every_drafter(bf16_model, drafter):
    make = {
        "none": lambda: None,
        "ngram": NgramDrafter,
        "model": lambda: ModelDrafter(bf16_model, bf16_model),  # the target as its own draft: same tokenizer
        "eagle": lambda: EagleDrafter(bf16_model),
        "eagle-tree": lambda: EagleDrafter(bf16_model, tree=True),
    }[drafter]
    k = 16 if drafter == "eagle-tree" else 4
    out = SpeculativeDecoder(bf16_model, make(), k=k, k_policy="fixed").generate(PROMPT, max_new_tokens=24)
    assert out.stats.new_tokens >= 1 and out.text.strip()
    if drafter in ("model", "eagle", "eagle-tree"):
        assert out.stats.drafted > 0 and out.stats.accepted > 0


def test_audit_passes_in_bfloat16(bf16_model):
    decoder = SpeculativeDecoder(bf16_model, NgramDrafter(), k=8, k_policy="fixed")
    prompt_ids = decoder.encode(DEFAULT_AUDIT_PROMPT, raw=True)
    report = run_audit(decoder, prompt_ids, temperature=1.0, samples=150, positions=3, seed=0)
    assert report.passed, report.to_dict()


def test_packed_float32_greedy_equals_transformers_generate_on_plain_weights(default_model):
    """verispec runs prepacked weights where the CPU can; transformers' generate runs the plain ones. On these prompts
    the greedy tokens agree (the share over Spec-Bench is measured by experiments/kernel_identity.py, docs/results-archive.md)."""
    plain = load_model("smollm2-135m", dtype="float32", pack=False)
    decoder = SpeculativeDecoder(default_model)
    for prompt in PROMPTS:
        ours = decoder.generate(prompt, max_new_tokens=64)
        ids = torch.tensor([ours.prompt_token_ids])
        with torch.inference_mode():
            theirs = plain.model.generate(ids, max_new_tokens=64, do_sample=False)[0, ids.shape[1]:].tolist()
        assert ours.token_ids == theirs, prompt
