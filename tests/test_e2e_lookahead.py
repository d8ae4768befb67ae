"""Lookahead decoding on the real built-in model (transformers; the OpenVINO run is in test_e2e_openvino.py): greedy
output identical to plain decoding with guesses accepted, the pure Jacobi window (no context pool) too, and the audit
at temperature 0.7. Marked e2e; run in CI."""

import pytest

from verispec import SpeculativeDecoder
from verispec.audit import run_audit
from verispec.drafters.lookahead import LookaheadDrafter

pytestmark = pytest.mark.e2e

PROMPTS = ["Explain how a refrigerator keeps food cold, step by step.",
           "Write a Python function that merges two sorted lists, and explain it."]


@pytest.mark.parametrize("context_pool", [True, False])
def test_greedy_output_is_plain_decodings(default_model, context_pool):
    plain = SpeculativeDecoder(default_model)
    spec = SpeculativeDecoder(default_model, LookaheadDrafter(context_pool=context_pool), k=16, k_policy="fixed")
    accepted = 0
    for prompt in PROMPTS:
        got = spec.generate(prompt, max_new_tokens=64)
        assert got.token_ids == plain.generate(prompt, max_new_tokens=64).token_ids, prompt
        accepted += got.stats.accepted
    assert accepted >= 8  # the window's and the pool's guesses are taken, not just verified


def test_audit_passes_at_temperature_0_7(default_blocks):
    decoder = SpeculativeDecoder(default_blocks, LookaheadDrafter(), k=8, k_policy="fixed")
    prompt_ids = decoder.encode("Write a short poem about the sea.")
    report = run_audit(decoder, prompt_ids, temperature=0.7, samples=150, positions=3, seed=0)
    assert report.passed, report.to_dict()
    assert report.draft_steps > report.steps / 2 and report.accepted > 0
