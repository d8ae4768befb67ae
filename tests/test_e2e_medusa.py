"""Medusa heads on the real built-in model with the set shipped for it: greedy output identical to plain decoding
(chains and trees) with drafts accepted, and the audit at temperature 0.7 on trees of deterministic candidates. The
llama.cpp run is in test_e2e_llamacpp.py. Marked e2e; run in CI."""

import pytest

from verispec import SpeculativeDecoder
from verispec.audit import run_audit
from verispec.drafters.medusa import MedusaDrafter

pytestmark = pytest.mark.e2e

PROMPTS = ["Explain how a refrigerator keeps food cold, step by step.",
           "Write a Python function that merges two sorted lists, and explain it."]


@pytest.mark.parametrize("tree", [False, True])
def test_greedy_output_is_plain_decodings(default_model, tree):
    plain = SpeculativeDecoder(default_model)
    drafter = MedusaDrafter(default_model, tree=tree)
    spec = SpeculativeDecoder(default_model, drafter, k=10 if tree else 4, k_policy="fixed")
    steps = tokens = 0
    for prompt in PROMPTS:
        got = spec.generate(prompt, max_new_tokens=64)
        assert got.token_ids == plain.generate(prompt, max_new_tokens=64).token_ids, prompt
        steps += got.stats.verify_steps
        tokens += sum(got.stats.step_tokens)
    assert tokens / steps > 1.1  # the shipped heads' guesses are taken, not just verified
    assert drafter.heads.config.training["best_validation"]["top1"][0] > 0.2


def test_audit_passes_at_temperature_0_7_on_trees(default_blocks):
    # trees only: sampled chains of a drafter's own q are audited on this model with the layer-skip drafter
    # (test_e2e_layerskip.py) and with a draft model (test_e2e_qwen_pair.py), and both of Medusa's acceptance paths
    # against exact joint distributions on tiny models (tests/test_medusa.py)
    decoder = SpeculativeDecoder(default_blocks, MedusaDrafter(default_blocks, tree=True), k=8, k_policy="fixed")
    prompt_ids = decoder.encode("Write a short poem about the sea.")
    report = run_audit(decoder, prompt_ids, temperature=0.7, samples=150, positions=3, seed=0)
    assert report.passed, report.to_dict()
    assert report.draft_steps > report.steps / 2 and report.accepted > 0
