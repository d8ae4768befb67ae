"""Continuous batching on the real built-in model, both backends: every request's greedy output equals its lone
plain output whatever shares its passes (mixed prompt lengths, drafters, joins and leaves). Marked e2e."""

import pytest

from verispec import SpeculativeDecoder, make_drafter
from verispec.batching import BatchEngine

pytestmark = pytest.mark.e2e

PROMPTS = [
    "Repeat this list exactly, one item per line: alpha beta gamma delta epsilon zeta eta theta iota kappa",
    "Write a short poem about the sea.",
    "Summarize in one sentence: The committee met on Tuesday to review the budget. The committee approved the "
    "budget for roads and schools, and the committee postponed the vote on the new library until next month.",
    "What is 12 times 11? Answer with the number, then explain in one line.",
    "List three colours.",
]
LENGTHS = [40, 24, 36, 30, 16]


def check_batch(target, drafters, max_batch):
    ref = [SpeculativeDecoder(target).generate(p, max_new_tokens=n).token_ids for p, n in zip(PROMPTS, LENGTHS)]
    engine = BatchEngine(target, max_batch=max_batch, prefill_chunk=16)
    seqs = []
    for i, (prompt, n) in enumerate(zip(PROMPTS, LENGTHS)):
        name = drafters[i % len(drafters)]
        drafter = make_drafter(name, target=target, draft_model=target if name == "model" else None)
        decoder = SpeculativeDecoder(target, drafter, k=5, k_policy="fixed")
        seqs.append(engine.submit(decoder, decoder.request(prompt, max_new_tokens=n)))
    engine.run()
    for seq, r, prompt in zip(seqs, ref, PROMPTS):
        assert seq.error is None, seq.error
        assert seq.result.token_ids == r, prompt
    assert engine.counters.speculating > 0
    assert engine.counters.sequences > engine.counters.passes  # passes were shared
    # the chat template's system prompt is shared: later prompts copied it from a cached sequence (an EAGLE
    # drafter's only from one that kept the same hidden states; the first EAGLE request has none to copy from)
    sharing = [s for s in seqs[1:] if not s.decoder.feature_layers]
    assert sharing and all(s.result.stats.reused_prompt_tokens >= 20 for s in sharing)
    assert engine.counters.reused_prompt_tokens == sum(s.result.stats.reused_prompt_tokens for s in seqs)
    return engine


def test_batched_greedy_equals_lone_plain_on_transformers(default_model):
    check_batch(default_model, ["none", "ngram", "model"], max_batch=3)


def test_batched_greedy_equals_lone_plain_on_llamacpp(llama_f32):
    check_batch(llama_f32, ["none", "ngram", "eagle"], max_batch=3)
