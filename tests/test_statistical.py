"""Sampled speculative output follows the target's distribution, checked against exact probabilities.

The tiny target has a 32-token vocabulary, so the joint distribution of the first three generated
tokens (32^3 outcomes) is computed exactly by enumeration and compared with samples by chi-square.
The same test must *fail* for the lossy typical-acceptance mode, which shows it has power.
"""

import copy

import pytest
import torch

from verispec import ModelDrafter, NgramDrafter, SamplingParams, SpeculativeDecoder
from statistical_helpers import ALPHA, PROMPT, SAMPLES, exact_joint, joint_p_value, sampled_joint
from verispec.audit import chi_square, run_audit

CASES = {
    "model-draft-t1": (lambda t, d: ModelDrafter(d, t), SamplingParams(temperature=1.0)),
    "ngram-onehot-t1": (lambda t, d: NgramDrafter(), SamplingParams(temperature=1.0)),
    "model-draft-topk-topp": (lambda t, d: ModelDrafter(d, t), SamplingParams(temperature=0.8, top_k=8, top_p=0.9)),
    "ngram-topp": (lambda t, d: NgramDrafter(), SamplingParams(temperature=1.2, top_p=0.8)),
}


@pytest.mark.parametrize("case", CASES)
def test_strict_speculative_sampling_matches_exact_joint_distribution(tiny_target, tiny_noisy_draft, case):
    make, sampling = CASES[case]
    decoder = SpeculativeDecoder(tiny_target, make(tiny_target, tiny_noisy_draft), k=3, k_policy="fixed")
    assert joint_p_value(decoder, sampling) > ALPHA


def _padded(target):
    """The tiny target as if its passes were padded like OpenVINO's static widths (a pass of n tokens computes the
    next of 2, 4 and 6): the engine then fills the padding with prompt-lookup guesses."""

    class Padded(type(target)):
        def pass_width(self, widths):
            return sum(next((w for w in (2, 4, 6) if w >= n), n) for n in widths)

    padded = copy.copy(target)
    padded.__class__ = Padded
    return padded


def test_guesses_in_filled_padding_keep_the_exact_joint_distribution(tiny_target):
    """A drafter that rarely matches (3-grams) leaves plain steps, whose padding slot carries a 1-gram guess: the
    output still follows the target's distribution exactly, and guesses were verified in the first three tokens."""
    decoder = SpeculativeDecoder(_padded(tiny_target), NgramDrafter(min_n=3, max_n=3), k=3, k_policy="fixed")
    filled = [decoder.generate(PROMPT, max_new_tokens=3, temperature=1.0, seed=s).stats.filled for s in range(50)]
    assert sum(filled) > 25
    assert joint_p_value(decoder, SamplingParams(temperature=1.0)) > ALPHA


def test_plain_sampling_matches_exact_joint_distribution(tiny_target):
    assert joint_p_value(SpeculativeDecoder(tiny_target), SamplingParams(temperature=1.0)) > ALPHA


def lossy_prompt(target):
    """[5, 9, x, 5, 9] where the drafted x has target probability in (0.1, 0.7) after the prompt: there
    typical acceptance always accepts x where the strict rule accepts it only with probability p(x).
    (Where p(x) is below the typical threshold, typical acceptance rejects and samples p: no distortion.)"""
    with torch.no_grad():
        for x in range(3, target.vocab_size):
            prompt = [5, 9, x, 5, 9]
            p = torch.softmax(target.model(torch.tensor([prompt])).logits[0, -1], -1)
            if 0.1 < p[x] < 0.7:
                return prompt
    raise AssertionError("no suitable prompt for the tiny model")


def test_lossy_typical_acceptance_fails_the_same_test(tiny_target):
    decoder = SpeculativeDecoder(tiny_target, NgramDrafter(), k=3, k_policy="fixed", acceptance="typical")
    prompt = lossy_prompt(tiny_target)
    sampling = SamplingParams(temperature=1.0)
    observed = sampled_joint(decoder, prompt, sampling)
    _, _, p_value, _ = chi_square(observed, exact_joint(tiny_target, prompt, sampling) * SAMPLES)
    assert p_value < 1e-6


def test_audit_passes_strict_and_fails_typical(tiny_target, tiny_noisy_draft):
    strict = SpeculativeDecoder(tiny_target, ModelDrafter(tiny_noisy_draft, tiny_target), k=3, k_policy="fixed")
    report = run_audit(strict, PROMPT, temperature=1.0, samples=600, positions=3, seed=100)
    assert report.passed, report.to_dict()
    assert [t.position for t in report.positions] == [1, 2, 3] and all(t.dof > 3 for t in report.positions)
    assert report.steps >= 600 and report.draft_steps > 0 and 0 < report.accepted <= report.drafted  # exercised
    plain = run_audit(SpeculativeDecoder(tiny_target), PROMPT, temperature=1.0, samples=20, positions=3, seed=1)
    assert plain.drafted == 0 and plain.steps == 60
    lossy = SpeculativeDecoder(tiny_target, NgramDrafter(), k=3, k_policy="fixed", acceptance="typical")
    report = run_audit(lossy, lossy_prompt(tiny_target), temperature=1.0, samples=600, positions=3, seed=100)
    assert not report.passed and report.lossy
    assert min(t.p_value for t in report.positions) < 1e-6


def test_the_teacher_forcer_answers_a_repeated_continuation_from_its_memo(tiny_target):
    from verispec.audit import TeacherForcer

    sampling = SamplingParams(temperature=0.8)
    forcer = TeacherForcer(tiny_target, PROMPT, sampling, memo_bytes=2 * 3 * tiny_target.vocab_size * 4)
    first = forcer.distributions([5, 9, 3]).clone()
    assert forcer.passes == 1
    assert torch.equal(forcer.distributions([5, 9, 3]), first) and forcer.passes == 1  # no second pass
    forcer.distributions([5, 9, 4])
    forcer.distributions([7, 1, 2])  # a third entry: the memo holds two, the oldest goes
    assert forcer.passes == 3 and len(forcer.memo) == 2 and (5, 9, 3) not in forcer.memo
    assert torch.equal(forcer.distributions([5, 9, 3]), first) and forcer.passes == 4  # computed again, same values
    assert torch.equal(TeacherForcer(tiny_target, PROMPT, sampling).distributions([5, 9, 3]), first)


def test_chi_square_arithmetic():
    stat, dof, p, cells = chi_square(torch.tensor([10.0, 20.0, 30.0]), torch.tensor([20.0, 20.0, 20.0]))
    assert (stat, dof, cells) == (10.0, 2, 3) and p == pytest.approx(0.006737947, rel=1e-6)
    # rare cells are pooled: the 2 + 1 expected pool (3 < 5) folds into the smallest common cell
    stat, dof, p, cells = chi_square(torch.tensor([50.0, 40.0, 6.0, 4.0]), torch.tensor([50.0, 47.0, 2.0, 1.0]))
    assert cells == 2 and dof == 1 and stat == pytest.approx(0.0)
    # an observation where the target has zero probability fails outright
    assert chi_square(torch.tensor([5.0, 1.0]), torch.tensor([6.0, 0.0]))[2] == 0.0
