"""The cost-aware controller: the rule on synthetic cost curves and acceptance, and the engine with it on."""

import pytest
from hypothesis import given, settings, strategies as st

from statistical_helpers import ALPHA, joint_p_value
from verispec import InvalidRequest, ModelDrafter, NgramDrafter, SamplingParams, SpeculativeDecoder
from verispec.analysis import expected_tokens
from verispec.controller import Acceptance, Controller, CostCurve, Decision, RunningMean


class FixedCosts(CostCurve):
    """A cost curve that is given, not measured: seconds(width) = base * (1 + slope * (width - 1))."""

    def __init__(self, slope: float, base: float = 0.01):
        super().__init__()
        self.slope, self.base = slope, base

    def observe(self, width, seconds):
        pass

    def measured(self):
        return {w: self(w) for w in range(1, 65)}

    def __bool__(self):
        return True

    def __call__(self, width):
        return self.base * (1 + self.slope * (width - 1))


def controller(slope: float, acceptance: float, draft_seconds_per_token: float = 0.0, **kwargs) -> Controller:
    c = Controller(FixedCosts(slope), **kwargs)
    c.history = Acceptance(prior=acceptance, weight=1e9)  # a known acceptance that observations cannot move
    c.start_request()
    c.draft_seconds_per_token = RunningMean(draft_seconds_per_token, 1e9)
    return c


# ---------------------------------------------------------------------- the pieces
def test_expected_tokens_is_one_plus_the_chance_of_reaching_each_position():
    assert expected_tokens([]) == 1.0
    assert expected_tokens([1.0, 1.0, 1.0]) == 4.0
    assert expected_tokens([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)


def test_cost_curve_fits_a_line_to_wide_passes_and_ignores_one_stall():
    curve = CostCurve()
    curve.observe(1, 1.0)
    assert curve(5) == pytest.approx(1.0 * (1 + 0.1 * 4))  # one width: the optimistic prior slope
    curve.observe(9, 3.0)
    assert curve(5) == pytest.approx(2.0) and curve(1) == 1.0  # through width 1 and the one wide width
    for w, t in ((2, 1.6), (5, 2.0), (9, 3.0), (17, 5.0)):
        curve.observe(w, t)
    curve.observe(8, 4.2)  # one noisy width measured once (the line says 2.75 there)
    assert 2.8 < curve(9) < 3.4 and 4.6 < curve(17) < 5.6 and curve(8) < 3.3  # the line, not the outlier
    for _ in range(20):
        curve.observe(1, 1.0)
    curve.observe(1, 100.0)  # a stall counts as at most 3x the mean
    assert curve(1) < 1.3
    assert curve(30) > curve(17) > curve(2) >= curve(1)


def test_a_requests_first_proposal_is_not_a_per_token_draft_cost():
    c = Controller(FixedCosts(0.1))
    c.observe_draft(4, 0.4)  # read the whole prompt first
    c.observe_draft(4, 0.004)
    assert c.draft_cost(1) == pytest.approx(0.001)
    c.start_request()
    c.observe_draft(2, 1.0)
    assert c.draft_cost(1) == pytest.approx(0.001)


def test_a_draft_models_catch_up_is_kept_apart_from_what_a_draft_token_costs():
    """After plain steps a draft model first reads the tokens it missed. Counted as drafting, that time made each
    draft token look dear (the controller then stayed plain); it is learnt per caught-up token instead."""
    c = Controller(FixedCosts(0.1))
    c.observe_draft(4, 0.5, catch_up=100, catch_up_seconds=0.4)  # the prompt, read by the first proposal
    assert c.draft_cost(1) == pytest.approx(0.025) and c.catch_up_seconds_per_token.value == pytest.approx(0.004)
    c.observe_draft(4, 0.1 + 0.02, catch_up=20, catch_up_seconds=0.1)
    assert c.catch_up_seconds_per_token.value == pytest.approx((0.004 + 0.005) / 2)
    assert c.draft_cost(1) == pytest.approx((0.025 + 0.005) / 2)  # (0.12 - 0.1) / 4 per token, not 0.12 / 4
    c.start_request(prompt_tokens=41)  # the draft reads a new request's prompt with its first proposal
    assert c.state.behind == 40


def test_going_back_to_drafting_pays_the_catch_up_and_a_probe_is_judged_without_it():
    c = controller(slope=0.05, acceptance=0.6, draft_seconds_per_token=0.001)
    assert c.draft_budget(4).n > 0 and c.state.behind == 0
    # a plain step is 0.01 s; each token the draft has not read costs 0.004 s to catch up on, spread over the 8
    # steps a probe interval gives: 40 tokens add 0.02 s to each, more than the ~1.5x gain of drafting
    c.catch_up_seconds_per_token = RunningMean(0.004, 1e9)
    c.state.speculating, c.state.behind = False, 40
    assert c.draft_budget(4).n == 0 and c.state.behind == 41
    c.observe_draft(2, 0.002 + 0.16, catch_up=41, catch_up_seconds=0.16)  # a probe caught up and drafted
    assert c.state.behind == 0 and c.draft_budget(4).n > 0  # nothing owed: back to drafting
    no_catch_up = controller(slope=0.05, acceptance=0.6, draft_seconds_per_token=0.001)
    no_catch_up.state.speculating = False
    assert no_catch_up.draft_budget(4).n > 0  # the same step without a catch-up to pay speculates


def test_a_drafter_that_could_not_pay_with_every_token_accepted_is_not_probed():
    """llama.cpp's quantized kernels on a 2-core Zen 3: a 2-token pass costs ~2.4 one-token passes, so a draft model
    cannot pay even if every token is taken; its probes only cost catch-ups (0.72x plain decoding, measured)."""
    c = controller(slope=1.2, acceptance=0.9, draft_seconds_per_token=0.003)
    assert not any(c.draft_budget(4).n for _ in range(300))
    assert c.state.probe_interval == c.first_probe_interval  # none tried, none failed
    cheap = controller(slope=0.3, acceptance=0.05, draft_seconds_per_token=0.002)  # could pay: probed
    assert any(cheap.draft_budget(4).probe for _ in range(30))


def test_a_draft_model_reports_what_it_caught_up_on(tiny_target, tiny_noisy_draft):
    drafter = ModelDrafter(tiny_noisy_draft, tiny_target)
    context = [5, 9, 3, 5, 9, 4, 7]
    first = drafter.propose(context, 3)
    assert first.catch_up == len(context) - 1 and first.catch_up_seconds > 0  # the prompt
    step = drafter.propose([*context, first.tokens[0], 8], 3)  # one draft token accepted, then the target's token
    assert step.catch_up == 0
    later = drafter.propose([*context, first.tokens[0], 8, 1, 2, 3, 4], 3)  # 1, 2, 3 committed by plain steps
    assert later.catch_up == 3 and later.catch_up_seconds > 0  # 4 is the newest: read while drafting
    fresh = ModelDrafter(tiny_noisy_draft, tiny_target)
    assert fresh.propose([*context, first.tokens[0], 8, 1, 2, 3, 4], 3).tokens == later.tokens  # same drafts


def test_acceptance_counts_only_the_positions_reached():
    acc = Acceptance(prior=0.5, weight=0.0)
    acc.observe(verified=4, accepted=1)  # position 1 accepted, 2 rejected, 3 and 4 never reached
    assert acc.at(0) == 1.0 and acc.at(1) == 0.0 and len(acc.positions) == 2


# ---------------------------------------------------------------------- the rule
def test_expensive_verify_and_low_acceptance_choose_a_plain_step():
    c = controller(slope=1.0, acceptance=0.2, draft_seconds_per_token=0.002)
    assert c.draft_budget(8).n == 0  # a draft model: not even drafted
    cheap = controller(slope=1.0, acceptance=0.2)
    assert cheap.draft_budget(8).n == 8  # drafting is free: draft, then decide on the draft
    assert cheap.verify_length(8, None, deterministic=True).n == 0


def test_cheap_verify_and_high_acceptance_choose_long_drafts():
    c = controller(slope=0.02, acceptance=0.9, draft_seconds_per_token=0.0002)
    assert c.draft_budget(16).n >= 12
    assert c.verify_length(16, None, deterministic=True).n >= 12


def test_the_choice_follows_the_machine():
    """The same acceptance gives a long draft where verify is cheap and a short one where it is not."""
    cheap = controller(slope=0.05, acceptance=0.7).verify_length(16, None, deterministic=True).n
    costly = controller(slope=0.4, acceptance=0.7).verify_length(16, None, deterministic=True).n
    assert cheap > costly >= 1


def test_confidence_is_calibrated_against_what_was_accepted():
    c = Controller(FixedCosts(0.3))
    for _ in range(200):  # confident positions were accepted, unconfident ones rejected
        c.observe_verdict(2, 1, [0.95, 0.15])
    assert c.state.acceptance.calibrated(0.95) > 0.9 and c.state.acceptance.calibrated(0.15, 1) < 0.1
    assert c.verify_length(2, [0.95, 0.15], deterministic=True).n == 1
    assert c.verify_length(2, [0.15, 0.95], deterministic=True).n == 0


def test_a_lookup_drafter_pays_per_proposal_and_is_asked_for_the_whole_budget():
    """A drafter whose proposals cost the same whatever their length (flat_cost) is charged per proposal: a draft
    of 8 tokens costs what one of 1 did, so the budget asks for all 8 where per token it asked for fewer."""
    per_token = controller(slope=0.1, acceptance=0.5)
    flat = controller(slope=0.1, acceptance=0.5)
    flat.flat_cost = True
    for c in (per_token, flat):
        c.draft_seconds_per_token = RunningMean(0.0, 0.0, 0.1)
        c.state.drafted = True
        for _ in range(5):
            c.observe_draft(1, 0.002)  # one token's lookup: 20% of a one-token pass (not free)
    assert flat.draft_cost(8) == flat.draft_cost(1) == pytest.approx(0.002)
    assert per_token.draft_cost(8) == pytest.approx(8 * 0.002)
    assert not flat.drafting_is_cheap(8)
    assert flat.draft_budget(8).n == 8 and per_token.draft_budget(8).n < 8
    never = controller(slope=2.0, acceptance=0.05)  # nothing pays: a plain step either way
    never.flat_cost = True
    never.draft_seconds_per_token = RunningMean(0.002, 1e9)
    assert never.draft_budget(8).n == 0


def test_positions_after_the_first_are_calibrated_apart():
    """A draft's later positions are reached only when the ones before were accepted: at the same confidence they
    are calibrated on their own, so a draft whose first position often fails but whose matches then hold is
    verified further than one table for all positions would allow."""
    c = Controller(FixedCosts(0.15))
    for _ in range(100):
        c.observe_verdict(4, 0, [0.85] * 4)  # the first position rejected
        c.observe_verdict(4, 4, [0.85] * 4)  # or all four accepted
    acc = c.state.acceptance
    assert acc.calibrated(0.85) == pytest.approx(0.5, abs=0.15) and acc.calibrated(0.85, 1) > 0.9
    assert c.verify_length(4, [0.85] * 4, deterministic=True).n == 4
    one_table = Controller(FixedCosts(0.15))
    one_table.state.acceptance = Acceptance(prior=0.5, weight=1e9)  # every position calibrated as the first
    one_table.state.acceptance.calibrated = lambda confidence, position=0: 0.5
    assert one_table.verify_length(4, [0.85] * 4, deterministic=True).n < 4


def test_a_drafter_that_stops_early_drafts_by_its_confidences_not_by_positions_it_never_reached():
    """A draft model pays per token drafted. Asked for the tokens the acceptance by position says pay, it was kept
    at one token by a second position that failed early on and was never drafted again (0.98 accepted at the first
    position, 2026-12-08); a drafter that stops early is asked for the whole budget and stops where its tokens'
    calibrated confidences say another would not pay."""
    def trained(stops_early: bool) -> Controller:
        c = controller(slope=0.1, acceptance=0.9, draft_seconds_per_token=0.002, stops_early=stops_early)
        for _ in range(200):  # sure first positions accepted, unsure second ones rejected
            c.observe_verdict(2, 1, [0.95, 0.05])
        return c

    by_position = trained(stops_early=False)
    assert by_position.state.acceptance.at(1) < 0.05 and by_position.draft_budget(8) == Decision(1, *_rest(by_position))
    c = trained(stops_early=True)
    budget = c.draft_budget(8)
    assert budget.n == 8 and budget.open
    assert c.draft_more([0.95], 8) and c.draft_more([0.95, 0.95, 0.95], 8)  # sure tokens: go on
    assert not c.draft_more([0.95, 0.05], 8)  # an unsure one (its later positions were rejected): stop
    assert not c.draft_more([0.95] * 8, 8)  # the budget is the ceiling
    dear = controller(slope=0.1, acceptance=0.9, draft_seconds_per_token=0.05, stops_early=True)  # 5 passes a token
    assert not dear.draft_more([0.95], 8)
    assert controller(slope=0.1, acceptance=0.9, policy="fixed", stops_early=True).draft_budget(8) == \
        Decision(8, 1.0, 0.0)  # the fixed policy verifies what it asked for: nothing stops early


def test_a_later_position_never_reached_at_a_confidence_says_what_the_first_position_does():
    """An uncalibrated drafter (a head whose largest probability is 0.15 while its tokens are accepted) stopped at
    one token by the later positions' table at its bin's middle (0.15) would never reach them to learn otherwise:
    until a later position is seen at that confidence, it reads the first position's table, and starts from it."""
    acc = Acceptance()
    for _ in range(100):
        acc.observe(1, 1, [0.15])  # first positions at 0.15, all accepted
    assert acc.calibrated(0.15) > 0.95 and acc.calibrated(0.15, 1) == acc.calibrated(0.15)
    assert acc.calibrated(0.85, 1) == pytest.approx(0.85)  # nothing seen at 0.85 anywhere: the bin's middle
    acc.observe(2, 1, [0.15, 0.15])  # a second position reached, rejected
    assert 0.5 < acc.calibrated(0.15, 1) < acc.calibrated(0.15)  # it started from the first position's value
    copy = acc.copy(4.0)
    assert copy.calibrated(0.15, 1) == acc.calibrated(0.15, 1) and copy.later_seen == acc.later_seen


def _rest(c: Controller) -> tuple[float, float]:
    d = c.draft_budget(8)
    return d.predicted_tokens, d.predicted_seconds


@settings(max_examples=200, deadline=None)
@given(conf=st.lists(st.floats(0, 1), min_size=1, max_size=12), tail=st.lists(st.floats(0, 1), max_size=12),
       slope=st.floats(0.01, 2.0))
def test_sampled_drafts_are_cut_by_a_stopping_rule(conf, tail, slope):
    """Whether position i is verified may depend on the confidences of positions 1..i only: changing what comes
    after the first unverified position never changes the decision (otherwise sampled tokens would be verified
    selectively by values they influence, which is not lossless)."""
    c = Controller(FixedCosts(slope))
    for _ in range(50):
        c.observe_verdict(2, 1, [0.9, 0.1])
    n = c.verify_length(len(conf), conf, deterministic=False).n
    changed = conf[: n + 1] + tail[: max(0, len(conf) - n - 1)]
    changed += conf[len(changed):]
    assert c.verify_length(len(changed), changed, deterministic=False).n == n


def test_no_flapping_near_break_even():
    c = controller(slope=0.5, acceptance=0.45, draft_seconds_per_token=0.001)
    decisions = [c.draft_budget(4).n > 0 for _ in range(60)]
    switches = sum(a != b for a, b in zip(decisions, decisions[1:]))
    assert switches <= 2 * (60 // c.first_probe_interval) + 1  # only the probes in and out


def test_probes_back_off_when_they_fail_and_reset_when_they_succeed():
    c = controller(slope=0.3, acceptance=0.05, draft_seconds_per_token=0.002, first_probe_interval=4,
                   max_probe_interval=16)
    probes = []
    for step in range(80):
        d = c.draft_budget(8)
        if d.n:
            assert d.probe and 1 <= d.n <= c.probe_length
            probes.append(step)
            c.observe_verdict(d.n, 0)
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert probes[0] == 3 and gaps[:3] == [8, 16, 16]  # every 4th step, then 8th, then 16th (the cap)
    c.state.probe_pending = True
    c.observe_verdict(2, 2)
    assert c.state.probe_interval == 4


def test_fixed_policy_verifies_what_is_drafted_and_bad_policies_are_rejected():
    c = controller(slope=1.0, acceptance=0.05, policy="fixed")
    assert c.draft_budget(6).n == 6 and c.verify_length(6, [0.0] * 6, deterministic=True).n == 6
    with pytest.raises(InvalidRequest, match="k policy"):
        Controller(CostCurve(), policy="always")


def test_a_tree_probe_brings_the_next_one_closer_only_if_it_paid_for_its_wide_pass():
    """A tree probes with its whole budget, and almost every tree gets a token or two accepted; what matters is
    whether the step paid: here a pass over the pending token and 10 nodes costs 4 plain steps, so a probe that
    commits 3 tokens backs the probing off like a failed one (on an EPYC with a compiled step, tree probes every
    8th step had run 0.81x plain decoding at temperature 0.7), and one that commits 4 brings the next one close."""
    c = controller(slope=0.3, acceptance=0.1, first_probe_interval=4, max_probe_interval=32)
    probes = []
    for step in range(120):
        d = c.draft_budget(10, tree_depth=4)
        if d.n:
            assert d.probe and d.n == 10
            probes.append(step)
            c.observe_verdict(4, 2)  # 3 tokens committed: not enough for a pass of 4 steps
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert c.state.probe_needs == pytest.approx(4.0) and gaps[:3] == [8, 16, 32]
    c.state.probe_pending = True
    c.observe_verdict(4, 3)  # 4 tokens: it paid
    assert c.state.probe_interval == 4


def test_trees_spend_the_whole_budget_or_none():
    assert controller(slope=0.05, acceptance=0.8).draft_budget(12, tree_depth=4).n == 12
    assert controller(slope=1.0, acceptance=0.1, draft_seconds_per_token=0.001).draft_budget(12, tree_depth=4).n == 0


# ---------------------------------------------------------------------- in the engine
def with_costs(decoder: SpeculativeDecoder, slope: float) -> SpeculativeDecoder:
    decoder.controller.costs = FixedCosts(slope)
    return decoder


@pytest.mark.parametrize("slope", [0.05, 0.5, 3.0])
def test_greedy_output_is_identical_whatever_the_controller_decides(tiny_target, tiny_noisy_draft, slope):
    prompt = [5, 9, 3, 5, 9, 4, 7, 5, 9, 3]
    expected = SpeculativeDecoder(tiny_target).generate(prompt, max_new_tokens=40).token_ids
    for drafter in (NgramDrafter(), ModelDrafter(tiny_noisy_draft, tiny_target)):
        decoder = with_costs(SpeculativeDecoder(tiny_target, drafter, k=6), slope)
        assert decoder.controller.flat_cost == (drafter.name == "ngram")  # a lookup pays per proposal
        out = decoder.generate(prompt, max_new_tokens=40)
        assert out.token_ids == expected, (drafter.name, slope)
        st_ = out.stats
        assert st_.k_policy == "cost" and len(st_.step_budget) == st_.verify_steps
        assert st_.predicted_speedup is not None and st_.measured_speedup is not None


def test_a_draft_model_stops_where_the_controller_says_and_keeps_the_output(tiny_target, tiny_noisy_draft):
    """The engine asks a draft model for the whole budget with the controller's stopping rule: drafts end at
    different lengths short of the budget, and greedy output is plain decoding's."""
    prompt = [5, 9, 3, 5, 9, 4, 7, 5, 9, 3]
    expected = SpeculativeDecoder(tiny_target).generate(prompt, max_new_tokens=40).token_ids
    drafter = ModelDrafter(tiny_noisy_draft, tiny_target)
    asked, real = [], drafter.propose

    def spy(context, k, enough=None):
        draft = real(context, k, enough=enough)
        asked.append((k, len(draft), enough is not None))
        return draft

    drafter.propose = spy
    decoder = with_costs(SpeculativeDecoder(tiny_target, drafter, k=6), 0.1)
    decoder.controller.costs.base = 0.02  # drafting is not free next to a pass (else the whole budget is drafted)
    assert decoder.generate(prompt, max_new_tokens=40).token_ids == expected
    opened = [(k, n) for k, n, rule in asked if rule]
    assert opened and max(k for k, _ in opened) == 6  # the budget (less near the end of the output)
    assert len({n for _, n in opened}) >= 2 and any(n < k for k, n in opened), asked


def test_the_cheaper_the_verify_the_more_it_speculates(tiny_target, tiny_noisy_draft):
    prompt = [5, 9, 3, 5, 9, 4, 7, 5, 9, 3]
    share = {}
    for slope in (0.0, 3.0):
        decoder = with_costs(SpeculativeDecoder(tiny_target, ModelDrafter(tiny_noisy_draft, tiny_target), k=6), slope)
        decoder.controller.costs.base = 1.0  # a pass costs far more than drafting with the tiny draft model
        st_ = decoder.generate(prompt, max_new_tokens=40).stats
        share[slope] = st_.plain_steps / st_.verify_steps
    assert share[0.0] < 0.2 and share[3.0] > 0.5, share  # free verify: speculate; 4x per wide pass: mostly plain


def test_sampling_with_the_controller_cutting_drafts_is_lossless(tiny_target, tiny_noisy_draft):
    """The controller cuts sampled drafts at lengths chosen from the draft model's confidence; the output
    still matches the target's exact joint distribution."""
    decoder = with_costs(SpeculativeDecoder(tiny_target, ModelDrafter(tiny_noisy_draft, tiny_target), k=3), 0.4)
    decoder.controller.costs.base = 1.0  # a pass costs far more than drafting, however busy the machine is
    sampling = SamplingParams(temperature=1.0)
    assert joint_p_value(decoder, sampling) > ALPHA
    out = decoder.generate([5, 9, 3, 5, 9], max_new_tokens=60, temperature=1.0, seed=3)
    assert len(set(out.stats.step_drafted)) >= 2, out.stats.step_drafted  # drafts were cut at different lengths


def test_stats_and_summary_report_the_controller(tiny_target):
    out = with_costs(SpeculativeDecoder(tiny_target, NgramDrafter(), k=4), 2.0).generate(
        [5, 9, 3, 5, 9, 4], max_new_tokens=20)
    d = out.stats.to_dict()
    for key in ("k_policy", "step_budget", "plain_steps", "probes", "predicted_speedup", "measured_speedup"):
        assert key in d
    assert "k policy cost" in out.stats.summary()
    plain = SpeculativeDecoder(tiny_target).generate([5, 9, 3], max_new_tokens=5).stats
    assert plain.k_policy == "" and "k policy" not in plain.summary()


def test_a_request_stuck_in_plain_steps_drifts_back_to_the_drafters_history():
    """Unlucky early drafts push a request's estimate below break-even; plain steps observe nothing, so without
    ageing that evidence a drafter that pays on the rest of the answer would stay off until a lucky probe. The
    estimate drifts towards the drafter's long run (not its recent history, which the same failures dragged down)."""
    c = controller(slope=0.3, acceptance=0.8, draft_seconds_per_token=0.001, first_probe_interval=1000)
    c.longrun = Acceptance(prior=0.8, weight=1e9, smoothing=0.0)  # hundreds of earlier drafts, mostly taken
    for _ in range(40):
        c.observe_verdict(4, 0)  # the request's own drafts all fail
    assert c.state.acceptance.at(0) < 0.2 and c.draft_budget(4).n == 0
    plain = 1
    while c.draft_budget(4).n == 0:
        plain += 1
        assert plain < 100, "never drafted again"
    assert c.state.acceptance.at(0) > 0.4 and not c.state.probe_pending  # the rule itself, not a probe
    # a drafter whose long run is as poor as the request stays plain
    c = controller(slope=0.3, acceptance=0.05, draft_seconds_per_token=0.001, first_probe_interval=1000)
    c.longrun = Acceptance(prior=0.05, weight=1e9, smoothing=0.0)
    assert all(c.draft_budget(4).n == 0 for _ in range(200))


def test_a_wide_width_measured_during_a_stall_does_not_make_every_draft_look_dear():
    """The stored curve of a real run (ms, EAGLE on the default model, 2 cores): widths 2-11 on a line, 12 and 13
    measured once each while the machine stalled. The fitted line must follow the many, not the two."""
    measured = {2: 25.4, 3: 24.1, 4: 27.4, 5: 27.2, 6: 28.6, 7: 30.5, 8: 30.2, 9: 32.1, 11: 35.4}
    curve = CostCurve()
    curve.observe(1, 0.0227)
    for _ in range(10):
        for w, ms in measured.items():
            curve.observe(w, ms / 1000)
    curve.observe(12, 0.1419)
    curve.observe(13, 0.0755)
    assert 0.0255 < curve(4) < 0.0285 and 0.034 < curve(11) < 0.037
    assert curve(5) - curve(4) < 0.002  # a draft token costs ~1.2 ms of pass, not ~5


def test_every_drafter_that_stops_early_takes_the_rule():
    """The engine passes ``enough`` to a drafter that declares ``stops_early`` (a subclass inherits the declaration:
    the layer-skip drafter, a draft model over the target's own layers, first overrode propose() without it)."""
    import inspect

    import verispec.bench.arctic_peer  # noqa: F401  (every drafter class defined)
    import verispec.drafters  # noqa: F401
    from verispec.drafters.base import DrafterBase

    def subclasses(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from subclasses(sub)

    stopping = [cls for cls in subclasses(DrafterBase) if cls.stops_early]
    assert {"ModelDrafter", "LayerSkipDrafter"} <= {cls.__name__ for cls in stopping}
    assert [cls.__name__ for cls in stopping if "enough" not in inspect.signature(cls.propose).parameters] == []
