"""Drafting while the target verifies (``--model-parallel``): same output, exact distribution, proposals reused."""

import logging

import pytest

from statistical_helpers import ALPHA, PROMPT, SAMPLES, exact_joint, sampled_joint
from tiny import assert_draft_cache_is_a_fresh_pass, loaded, noisy_copy
from verispec.audit import chi_square
from verispec import IncompatibleDrafter, ModelDrafter, SamplingParams, SpeculativeDecoder
from verispec.drafters import make_drafter
from verispec.drafters.model import ParallelModelDrafter

PROMPTS = [[5, 9, 3, 5, 9, 4, 7, 5, 9, 3], [1, 2, 3, 4, 5, 6, 7, 8]]


@pytest.mark.parametrize("k_policy", ["fixed", "cost"])
def test_greedy_output_equals_plain_decoding(tiny_target, tiny_noisy_draft, tiny_other_draft, k_policy):
    for prompt in PROMPTS:
        expected = SpeculativeDecoder(tiny_target).generate(prompt, max_new_tokens=40).token_ids
        for draft in (tiny_noisy_draft, tiny_other_draft, tiny_target):
            drafter = ParallelModelDrafter(draft, tiny_target)
            out = SpeculativeDecoder(tiny_target, drafter, k=4, k_policy=k_policy).generate(prompt, max_new_tokens=40)
            assert out.token_ids == expected, (draft.name, prompt)


def test_a_draft_that_guesses_right_is_used_without_drafting_again(tiny_target, tiny_noisy_draft):
    perfect = ParallelModelDrafter(tiny_target, tiny_target)  # every token accepted and the bonus guessed
    out = SpeculativeDecoder(tiny_target, perfect, k=4, k_policy="fixed").generate(PROMPTS[0], max_new_tokens=41)
    assert out.stats.acceptance_rate == 1.0
    assert perfect.hits >= out.stats.verify_steps - 2 and perfect.misses <= 1
    noisy = ParallelModelDrafter(tiny_noisy_draft, tiny_target)
    SpeculativeDecoder(tiny_target, noisy, k=4, k_policy="fixed").generate(PROMPTS[0], max_new_tokens=40)
    assert noisy.misses > 0  # rejections: the worker's proposal was dropped
    # whatever the worker left behind, the draft's cache holds exactly the tokens it lists, as a fresh pass gives them
    noisy._join(stop=True)
    assert_draft_cache_is_a_fresh_pass(noisy, tiny_noisy_draft)


def test_a_proposal_taken_from_the_worker_is_the_one_a_sequential_draft_makes(tiny_target, tiny_noisy_draft):
    """Greedy drafts: the worker's proposal for a context equals a fresh sequential draft's, cut or extended to k."""
    ahead = ParallelModelDrafter(tiny_noisy_draft, tiny_target)
    first = ahead.propose(PROMPTS[0], 3)
    ahead._guessed.wait()
    context = [*PROMPTS[0], *first.tokens, ahead._guess]
    for k in (2, 3, 5):
        drafter = ParallelModelDrafter(tiny_noisy_draft, tiny_target)
        drafter.propose(PROMPTS[0], 3)
        got = drafter.propose(context, k)
        assert drafter.hits == 1 and got.tokens == ModelDrafter(tiny_noisy_draft, tiny_target).propose(context, k).tokens
        assert got.probs.shape[0] == k


def test_sampling_is_lossless_and_reproducible(tiny_target, tiny_noisy_draft):
    """Four tokens drafted one at a time: the second step's draft is the worker's whenever the first was accepted
    and the target's next token was the draft's guess; the joint of all four still is the target's. The draft is
    close enough to the target that both happen (~12% of runs), far enough that rejections happen too (~55%)."""
    close = loaded(noisy_copy(tiny_target.model, noise=0.02), tiny_target.tokenizer, name="tiny-close")
    drafter = ParallelModelDrafter(close, tiny_target)
    decoder = SpeculativeDecoder(tiny_target, drafter, k=1, k_policy="fixed")
    sampling = SamplingParams(temperature=1.0, top_k=4)
    exact = exact_joint(tiny_target, PROMPT, sampling, positions=4)
    observed = sampled_joint(decoder, PROMPT, sampling, positions=4)
    _, _, p_value, cells = chi_square(observed, exact * SAMPLES)
    assert cells > 20 and p_value > ALPHA
    assert drafter.hits > SAMPLES // 20 and drafter.misses > SAMPLES // 2, (drafter.hits, drafter.misses)  # the worker's proposals were verified, not only dropped
    runs = [decoder.generate(PROMPTS[0], max_new_tokens=40, temperature=0.8, seed=s).token_ids for s in (4, 4, 4, 5)]
    assert runs[0] == runs[1] == runs[2] and runs[0] != runs[3]


def test_a_failing_worker_costs_a_warning_not_the_answer(tiny_target, tiny_noisy_draft, caplog, monkeypatch):
    drafter = ParallelModelDrafter(tiny_noisy_draft, tiny_target)
    expected = SpeculativeDecoder(tiny_target).generate(PROMPTS[1], max_new_tokens=20).token_ids
    real = ParallelModelDrafter._draft
    calls = {"n": 0}

    def flaky(self, feed, k, generator, stop=None, enough=None):
        if stop is not None:  # the worker's drafting
            calls["n"] += 1
            if calls["n"] % 2:
                raise RuntimeError("the draft's context window is full")
        return real(self, feed, k, generator, stop, enough)

    monkeypatch.setattr(ParallelModelDrafter, "_draft", flaky)
    with caplog.at_level(logging.WARNING, logger="verispec.drafters.model"):
        out = SpeculativeDecoder(tiny_target, drafter, k=3, k_policy="fixed").generate(PROMPTS[1], max_new_tokens=20)
    assert out.token_ids == expected
    assert "drafting ahead failed (RuntimeError: the draft's context window is full)" in caplog.text


def test_the_option_reaches_the_registry(tiny_target, tiny_noisy_draft, tiny_other_draft):
    assert isinstance(make_drafter("model", target=tiny_target, draft_model=tiny_noisy_draft, parallel=True),
                      ParallelModelDrafter)
    assert type(make_drafter("model", target=tiny_target, draft_model=tiny_noisy_draft)) is ModelDrafter
    with pytest.raises(IncompatibleDrafter, match="--model-parallel"):
        make_drafter("model", target=tiny_target, draft_model=tiny_other_draft, parallel=True, retokenize="on")


def test_drafters_sharing_a_draft_model_take_turns_on_it(tiny_target, tiny_noisy_draft):
    """A server's slots share one draft model; a llama.cpp context or an OpenVINO request runs one pass at a time, so
    the workers and the foreground drafting of several drafters never run the model at once."""
    import threading
    import time

    running, overlaps = [0], []
    guard = threading.Lock()
    real = tiny_noisy_draft.forward

    def counted(*args, **kwargs):
        with guard:
            running[0] += 1
            overlaps.append(running[0])
        time.sleep(0.002)  # long enough for another thread to arrive
        try:
            return real(*args, **kwargs)
        finally:
            with guard:
                running[0] -= 1

    tiny_noisy_draft.forward = counted
    try:
        decoders = [SpeculativeDecoder(tiny_target, ParallelModelDrafter(tiny_noisy_draft, tiny_target), k=3,
                                       k_policy="fixed") for _ in range(3)]
        threads = [threading.Thread(target=d.generate, args=(PROMPTS[i % 2],), kwargs={"max_new_tokens": 20})
                   for i, d in enumerate(decoders)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        del tiny_noisy_draft.forward
    assert overlaps and max(overlaps) == 1


def test_a_command_that_ends_while_the_worker_drafts_exits_cleanly(tiny_dir):
    """The last proposal's worker may still be drafting when a one-shot command returns: the interpreter waits for it
    (as a daemon thread it was killed inside a torch call: "terminate called without an active exception", exit 134)."""
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "verispec", "generate", "w5 w9 w3 w5 w9", "--raw", "--target", str(tiny_dir),
         "--backend", "transformers", "--drafter", "model", "--draft-model", str(tiny_dir), "--model-parallel",
         "--k-policy", "fixed", "--k", "6", "--max-new-tokens", "20", "--json"],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "terminate called" not in result.stderr
    assert '"drafted"' in result.stdout
