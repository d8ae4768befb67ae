"""Continuous batching: batched passes equal lone ones, and a request's output does not depend on what else is in
the batch (greedy: token-identical to its batch-1 plain output; sampled: reproducible and lossless)."""

from __future__ import annotations

import pytest
import torch

from tiny import EOS, loaded, make_model
from verispec.audit import run_audit
from verispec.batching import BatchEngine, generate_batch
from verispec.controller import Controller, CostCurve
from verispec.drafters import EagleDrafter, ModelDrafter, NgramDrafter
from verispec.drafters.base import Draft
from verispec.engine import SpeculativeDecoder, StepPlan
from verispec.errors import InvalidRequest

# prompts of mixed lengths; some repeat themselves so the n-gram drafter finds matches
PROMPTS = [
    [1, 5, 6, 7, 8, 5, 6, 7],
    [1, 9],
    [1, 3, 4, 10, 11, 12, 3, 4, 10, 11, 12, 3, 4, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24],
    [1, 20, 21, 22, 20, 21],
    [1, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3,
     30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6],
    [1, 17, 18, 17, 18, 17],
]


def drafter_for(i, target, draft, head):
    return [None, NgramDrafter(), ModelDrafter(draft, target), EagleDrafter(target, head)][i % 4]


@pytest.fixture(scope="module")
def eagle_head(tiny_target):
    from test_eagle import random_head

    return random_head(tiny_target)


def lone(target, prompt, **options):
    return SpeculativeDecoder(target).generate(prompt, **options)


def test_the_batch_cache_holds_rows_for_the_sequences_that_joined_not_its_capacity(tiny_target):
    """One sequence in a group of 8 keeps one row of buffers; rows double as sequences join (a copy into a row that
    joined after the last pass included), and every sequence's logits stay its lone passes'."""
    torch.manual_seed(1)
    seqs = [torch.randint(3, 32, (n,)).tolist() for n in (6, 4, 7)]
    with torch.inference_mode():
        ref = [tiny_target.forward(tiny_target.new_kv(), s).logits for s in seqs]
        group = tiny_target.new_kv_group(8)
        first = group.new_kv()
        torch.testing.assert_close(tiny_target.forward(first, seqs[0]).logits, ref[0], atol=1e-5, rtol=0)
        assert {layer._keys.shape[0] for layer in group.cache.layers} == {1}
        second, third = group.new_kv(), group.new_kv()
        group.copy_prefix(first, third, 3)  # into a row the buffers do not hold yet
        assert {layer._keys.shape[0] for layer in group.cache.layers} == {3}  # the live rows (at least twice 1)
        outs = tiny_target.forward_batch([(second, seqs[1]), (third, seqs[0][3:])])
        torch.testing.assert_close(outs[0].logits, ref[1], atol=1e-5, rtol=0)
        torch.testing.assert_close(outs[1].logits, ref[0][3:], atol=1e-5, rtol=0)


def test_batched_pass_equals_lone_passes(tiny_target):
    torch.manual_seed(0)
    seqs = [torch.randint(3, 32, (n,)).tolist() for n in (5, 9, 3, 12)]
    with torch.inference_mode():
        ref = [tiny_target.forward(tiny_target.new_kv(), s).logits for s in seqs]
        group = tiny_target.new_kv_group(4)
        kvs = [group.new_kv() for _ in seqs]
        for kv, s in zip(kvs, seqs):  # each prompt in two single-row passes
            tiny_target.forward(kv, s[:2])
            tiny_target.forward(kv, s[2:4])
        rest = [(kv, s[4:]) for kv, s in zip(kvs, seqs) if len(s) > 4]  # one pass, ragged widths 1, 5, 8
        outs = tiny_target.forward_batch(rest)
        for out, (kv, s) in zip(outs, [(kv, s) for kv, s in zip(kvs, seqs) if len(s) > 4]):
            torch.testing.assert_close(out.logits, ref[seqs.index(s)][4:], atol=1e-5, rtol=0)
            assert len(kv) == len(s)
        assert len(kvs[2]) == 3  # not in the pass: only padding was written past its length
        # rollback of one row, refed in a pass with another row
        kvs[1].truncate(6)
        out = tiny_target.forward_batch([(kvs[1], seqs[1][6:]), (kvs[2], [7])])
        torch.testing.assert_close(out[0].logits, ref[1][6:], atol=1e-5, rtol=0)
        # a row leaves: the last row moves into its place and keeps its cache
        kvs[0].close()
        assert kvs[3].index == 0 and kvs[0].index is None
        out = tiny_target.forward_batch([(kvs[3], [4, 5])])
        full = tiny_target.forward(tiny_target.new_kv(), seqs[3] + [4, 5]).logits
        torch.testing.assert_close(out[0].logits, full[-2:], atol=1e-5, rtol=0)
        with pytest.raises(RuntimeError, match="in use"):
            for _ in range(2):
                group.new_kv()


def test_last_only_gives_each_row_its_own_last_logits(tiny_target):
    """A prefill on a batch row asks for the last token's logits only; with ragged rows each gets its own last."""
    torch.manual_seed(1)
    seqs = [torch.randint(3, 32, (n,)).tolist() for n in (7, 2, 5, 5)]
    with torch.inference_mode():
        ref = [tiny_target.forward(tiny_target.new_kv(), s).logits for s in seqs]
        group = tiny_target.new_kv_group(4)
        kvs = [group.new_kv() for _ in seqs]
        outs = tiny_target.forward_batch(list(zip(kvs, seqs)), last_only=True)
        for out, kv, s, r in zip(outs, kvs, seqs, ref):
            assert out.logits.shape == (1, r.shape[-1]) and len(kv) == len(s)
            torch.testing.assert_close(out.logits, r[-1:], atol=1e-5, rtol=0)
        # one row through forward(), as the batch engine prefills
        kv = tiny_target.new_kv_group(1).new_kv()
        out = tiny_target.forward(kv, seqs[0], last_only=True)
        assert out.logits.shape == (1, ref[0].shape[-1])
        torch.testing.assert_close(out.logits, ref[0][-1:], atol=1e-5, rtol=0)


@pytest.mark.parametrize("max_batch,chunk", [(3, 4), (6, 128)])
def test_greedy_output_does_not_depend_on_the_batch(tiny_target, tiny_noisy_draft, eagle_head, max_batch, chunk):
    """Mixed prompt lengths, every drafter, more requests than rows (sequences join as others leave), prompts
    prefilled in chunks while others decode, mixed max_new_tokens: each equals its lone plain greedy output."""
    lengths = [30, 12, 25, 40, 7, 33]
    ref = [lone(tiny_target, p, max_new_tokens=n).token_ids for p, n in zip(PROMPTS, lengths)]
    engine = BatchEngine(tiny_target, max_batch=max_batch, prefill_chunk=chunk)
    seqs = []
    for i, (p, n) in enumerate(zip(PROMPTS, lengths)):
        d = SpeculativeDecoder(tiny_target, drafter_for(i, tiny_target, tiny_noisy_draft, eagle_head), k=4,
                               k_policy="fixed")
        seqs.append(engine.submit(d, d.request(p, max_new_tokens=n)))
        if i == 2:  # the rest join while the first ones are decoding
            for _ in range(3):
                engine.step()
            assert engine.running
    sizes = []
    while engine.busy:
        engine.step()
        sizes.append(engine.size)
    assert max(sizes) == max_batch
    for seq, r in zip(seqs, ref):
        assert seq.error is None and seq.result.token_ids == r
    assert engine.counters.speculating > 0 and engine.counters.passes < sum(lengths)
    assert sum(s.result.stats.accepted for s in seqs) > 0


def test_stop_string_ends_one_sequence_while_others_continue(tiny_target):
    full = lone(tiny_target, PROMPTS[0], max_new_tokens=20)
    words = full.text.split()
    stop = " ".join(words[4:6])
    decoders = [SpeculativeDecoder(tiny_target, NgramDrafter(), k=3, k_policy="fixed") for _ in range(3)]
    engine = BatchEngine(tiny_target, max_batch=3)
    a = engine.submit(decoders[0], decoders[0].request(PROMPTS[0], max_new_tokens=20, stop=[stop]))
    b = engine.submit(decoders[1], decoders[1].request(PROMPTS[2], max_new_tokens=30))
    deltas = []
    c = engine.submit(decoders[2], decoders[2].request(PROMPTS[3], max_new_tokens=30), on_delta=deltas.append)
    finished_while_others_ran = False
    while engine.busy:
        engine.step()
        if a.result is not None and b.result is None:
            finished_while_others_ran = True
    assert finished_while_others_ran
    assert a.result.finish_reason == "stop" and a.result.text.rstrip() == " ".join(words[:4])
    assert a.result.token_ids == full.token_ids[: len(a.result.token_ids)]
    assert b.result.token_ids == lone(tiny_target, PROMPTS[2], max_new_tokens=30).token_ids
    assert "".join(deltas) == c.result.text


def test_joining_prompts_share_each_steps_prefill_budget(tiny_target):
    """While a stream decodes, a step feeds joining prompts ``prefill_chunk`` tokens in all, in arrival order: short
    prompts join in the same step (not one a step), a long one takes several steps cut where it would be cut alone
    (every ``prefill_chunk`` tokens, not at what is left of a step's budget), and no step feeds more."""
    engine = BatchEngine(tiny_target, max_batch=5, prefill_chunk=12, reuse_prefix=False)  # every token fed
    make = lambda: SpeculativeDecoder(tiny_target, NgramDrafter(), k=3)  # noqa: E731
    first = make()
    engine.submit(first, first.request(PROMPTS[0], max_new_tokens=60))
    engine.step()  # alone: prefilled whole, then decoding
    assert len(engine.running) == 1
    # fed before the pending last token: 1 + 5 + 27 prompt tokens
    joining = [PROMPTS[1], PROMPTS[3], PROMPTS[2]]
    seqs = [engine.submit(d, d.request(p, max_new_tokens=60)) for d, p in zip([make() for _ in joining], joining)]
    fed = []
    while any(s.state is None or s not in engine.running for s in seqs):
        before = engine.counters.prefill_tokens
        engine.step()
        fed.append(engine.counters.prefill_tokens - before)
    # the two short prompts (6 tokens) in one step; the long one's first 12 do not fit the 6 left, so 12, 12, 3
    assert fed == [6, 12, 12, 3]
    assert [s.result is None and s.error is None for s in seqs] == [True] * 3


def test_eos_and_cancel_leave_the_batch(tiny_target):
    target = loaded(tiny_target.model, tiny_target.tokenizer, eos=frozenset({EOS}))
    engine = BatchEngine(target, max_batch=2)
    decoders = [SpeculativeDecoder(target, NgramDrafter(), k=3) for _ in range(3)]
    done = []
    seqs = [engine.submit(d, d.request(p, max_new_tokens=60), on_done=done.append)
            for d, p in zip(decoders, PROMPTS[3:])]
    engine.step()
    engine.step()
    engine.cancel(seqs[0])
    engine.run()
    assert seqs[0] in done and seqs[0].result is None and seqs[0].cancelled
    for seq, p in zip(seqs[1:], PROMPTS[4:]):
        assert seq.result.token_ids == lone(target, p, max_new_tokens=60).token_ids
    # every cache given back but the finished ones', kept for the next prompts until dropped (the cancelled one's too)
    assert len(engine.kept) == 2 and engine.parked is engine.kept[-1]
    assert {id(row) for row in engine.group.rows} == {id(k.cache) for k in engine.kept}
    engine.drop_parked()
    assert engine.group.rows == [] and engine.parked is None


def test_sampled_output_is_reproducible_inside_a_batch(tiny_target, tiny_noisy_draft, eagle_head):
    opts = dict(max_new_tokens=25, temperature=0.9, top_p=0.95)

    def batch(order):
        decoders = [SpeculativeDecoder(tiny_target, drafter_for(i, tiny_target, tiny_noisy_draft, eagle_head), k=3,
                                       k_policy="fixed") for i in order]
        return generate_batch(decoders, [PROMPTS[i] for i in order], max_batch=3, seed=11, **opts)

    first = batch(range(6))
    again = batch(range(6))
    shuffled = batch([5, 3, 1, 0, 2, 4])
    assert [g.token_ids for g in first] == [g.token_ids for g in again]
    assert [first[i].token_ids for i in [5, 3, 1, 0, 2, 4]] == [g.token_ids for g in shuffled]
    for i, g in enumerate(first):  # the same draws as alone
        d = SpeculativeDecoder(tiny_target, drafter_for(i, tiny_target, tiny_noisy_draft, eagle_head), k=3,
                               k_policy="fixed")
        assert d.generate(PROMPTS[i], seed=11, **opts).token_ids == g.token_ids


@pytest.mark.parametrize("drafter", ["ngram", "model"])
def test_audit_passes_inside_a_busy_batch(tiny_target, tiny_noisy_draft, drafter):
    """Samples drawn 4 at a time with continuous batching, next to two long-running sequences on other prompts."""
    prompt = [1, 5, 6, 7, 5, 6]

    def make():
        return (NgramDrafter() if drafter == "ngram" else ModelDrafter(tiny_noisy_draft, tiny_target))

    def sampler(ids, seeds, options):
        engine = BatchEngine(tiny_target, max_batch=6, prefill_chunk=4)
        noise = [SpeculativeDecoder(tiny_target, make(), k=3, k_policy="fixed") for _ in range(2)]
        for d, p in zip(noise, PROMPTS[2:4]):
            engine.submit(d, d.request(p, max_new_tokens=200, temperature=0.8, seed=5))
        decoders = [SpeculativeDecoder(tiny_target, make(), k=3, k_policy="fixed") for _ in range(4)]
        seqs, free = [], list(decoders)
        pending = list(seeds)
        while pending or any(s.result is None for s in seqs):
            while pending and free:
                d = free.pop()
                seq = engine.submit(d, d.request(ids, seed=pending.pop(0), **options),
                                    on_done=lambda s: free.append(s.decoder))
                seqs.append(seq)
            engine.step()
        return [s.result for s in seqs]

    decoder = SpeculativeDecoder(tiny_target, make(), k=3, k_policy="fixed")
    report = run_audit(decoder, prompt, temperature=1.0, samples=600, positions=3, seed=0, sampler=sampler)
    assert report.passed, report.to_dict()


def test_load_makes_speculation_shrink():
    """With the pass's cost growing with its width, a sequence alone speculates; in a busy batch whose pass it
    would widen for everyone, it does not."""
    curve = CostCurve()
    for width in range(1, 80):
        curve.observe(width, 0.01 + 0.004 * width)  # 9 tokens cost 3.7x one (quantized weights on a CPU)
    ctrl = Controller(curve)
    assert 0.5 < ctrl.history.at(0) < 0.7  # the prior: a first draft token accepted 6 times in 10
    busy = (lambda w: 15 + w, 15.0)  # 15 other sequences in plain steps
    # drafting costs nothing next to a pass: the draft is made, verify_length decides
    ctrl.start_request()
    assert ctrl.verify_length(4, None, deterministic=True).n > 0
    ctrl.start_request()
    ctrl.share_passes(*busy)
    assert ctrl.verify_length(4, None, deterministic=True).n == 0
    ctrl.start_request()
    ctrl.share_passes(lambda w: 1 + w, other_tokens=1.0)  # one other plain sequence: still worth it
    assert ctrl.verify_length(4, None, deterministic=True).n > 0
    # drafting that costs time: draft_budget itself says 0 under load
    ctrl.draft_seconds_per_token.add(0.002)
    ctrl.start_request()
    ctrl.share_passes(None)
    assert ctrl.draft_budget(4).n > 0
    ctrl.start_request()
    ctrl.share_passes(*busy)
    assert ctrl.draft_budget(4).n == 0


def test_batch_errors_are_clear(tiny_target, eagle_head):
    with pytest.raises(InvalidRequest, match="max batch"):
        BatchEngine(tiny_target, max_batch=0)
    engine = BatchEngine(tiny_target, max_batch=2)
    tree = SpeculativeDecoder(tiny_target, EagleDrafter(tiny_target, eagle_head, tree=True), k=4)
    with pytest.raises(InvalidRequest, match="token trees"):
        engine.submit(tree, tree.request(PROMPTS[0]))
    other = loaded(make_model(seed=3))
    d = SpeculativeDecoder(other)
    with pytest.raises(InvalidRequest, match="another target"):
        engine.submit(d, d.request(PROMPTS[0]))
    with pytest.raises(InvalidRequest, match="its own decoder"):
        shared = SpeculativeDecoder(tiny_target)
        generate_batch([shared, shared], PROMPTS[:2])


class LinearCost:
    """A stand-in for the measured cost curve: a pass costs 0.1 s plus ``slope`` s per computed token."""

    key = None  # never stored for another process
    changed = False

    def __init__(self, slope: float) -> None:
        self.slope = slope

    def __bool__(self) -> bool:
        return True

    def __call__(self, width: int) -> float:
        return 0.1 + self.slope * width

    at = __call__

    def observe(self, width: int, seconds: float) -> None:
        pass


@pytest.mark.parametrize("accepted,slope", [(0, 0.01), (6, 0.0001)])
def test_padded_batch_cuts_drafts_to_one_shared_length(tiny_target, accepted, slope):
    """On a backend that pads rows to the widest, the batch cuts its cost-policy rows' drafts to one length chosen
    for the whole pass: to nothing when they are rarely accepted and a wide pass costs more, not at all when they
    are always accepted and width is nearly free. A fixed-policy row's draft is never cut. The cut is by length,
    never by token."""
    engine = BatchEngine(tiny_target, max_batch=4)
    decoders = [SpeculativeDecoder(tiny_target, NgramDrafter(), k=6) for _ in range(3)]
    decoders.append(SpeculativeDecoder(tiny_target, NgramDrafter(), k=6, k_policy="fixed"))
    seqs = [engine.submit(d, d.request(p, max_new_tokens=40)) for d, p in zip(decoders, PROMPTS)]
    while len(engine.running) < 4:
        engine.step()
    # after the steps: a decoding step takes the measured curve of the passes as they run (a program may come in)
    engine.costs = LinearCost(slope)
    engine._cap = None  # no shared length kept from the joining steps' passes (their costs were the real ones)
    for seq in engine.running:
        for _ in range(50):
            seq.decoder.controller.state.acceptance.observe(6, accepted)
    drafts = [[7, 8, 9, 10, 11, 12], [7, 8, 9], [], [7, 8]]
    plans = [StepPlan(Draft(list(d)), [seq.state.tokens[-1]], 0.0) for seq, d in zip(engine.running, drafts)]
    fixed_row = [seq.decoder.controller.policy for seq in engine.running].index("fixed")
    cap = engine._cap_drafts(engine.running, plans)
    lengths = [len(p.draft) for p in plans]
    expected = [len(d) if i == fixed_row else min(len(d), cap) for i, d in enumerate(drafts)]
    assert lengths == expected
    assert cap == (0 if accepted == 0 else 6)
    assert all(p.draft.tokens == d[: len(p.draft)] for p, d in zip(plans, drafts))
    engine.run()
    assert all(s.result is not None for s in seqs)


def test_fixed_policy_rows_are_never_cut(tiny_target):
    engine = BatchEngine(tiny_target, max_batch=2)
    engine.costs = LinearCost(0.05)
    fixed = SpeculativeDecoder(tiny_target, NgramDrafter(), k=6, k_policy="fixed")
    cost = SpeculativeDecoder(tiny_target, NgramDrafter(), k=6)
    a = engine.submit(fixed, fixed.request(PROMPTS[2], max_new_tokens=40))
    engine.submit(cost, cost.request(PROMPTS[3], max_new_tokens=40))
    engine.run()
    alone = SpeculativeDecoder(tiny_target, NgramDrafter(), k=6, k_policy="fixed").generate(PROMPTS[2],
                                                                                          max_new_tokens=40)
    assert a.result.stats.drafted == alone.stats.drafted > 0


SHARED = [1, 3, 4, 10, 11, 12, 3, 4, 10, 11, 12, 13, 14, 15, 16]  # a "system prompt" several requests start with


@pytest.mark.parametrize("max_batch", [1, 2])
def test_a_prompt_after_a_finished_one_takes_its_prefix(tiny_target, max_batch):
    """At one client the last finished sequence's cache is kept; the next prompt, sharing a prefix with it, copies
    that prefix into a free row and leaves the kept cache whole for a repeat of its prompt (max_batch 2), or, with no
    row free, takes it over after copying it out of the row (max_batch 1). It prefills only what differs either way,
    and a repeat of the first prompt then reuses all of it. Outputs equal the lone decoder's."""
    engine = BatchEngine(tiny_target, max_batch=max_batch)
    first, second = [*SHARED, 20, 21], [*SHARED, 30, 31, 2]
    d = SpeculativeDecoder(tiny_target, NgramDrafter(), k=3)
    a = engine.submit(d, d.request(first, max_new_tokens=10))
    engine.run()
    parked = engine.parked.cache
    assert a.result.stats.reused_prompt_tokens == 0 and engine.group.rows == [parked]
    d2 = SpeculativeDecoder(tiny_target, NgramDrafter(), k=3)
    b = engine.submit(d2, d2.request(second, max_new_tokens=10))
    engine.step()
    assert (b.state.cache is parked) == (max_batch == 1)
    assert len(engine.stored) == (1 if max_batch == 1 else 0)
    engine.run()
    assert b.result.stats.reused_prompt_tokens == len(SHARED)
    assert engine.counters.prefill_tokens == (len(first) - 1) + (len(second) - 1 - len(SHARED))
    assert b.result.token_ids == lone(tiny_target, second, max_new_tokens=10).token_ids
    d3 = SpeculativeDecoder(tiny_target, NgramDrafter(), k=3)
    c = engine.submit(d3, d3.request(first, max_new_tokens=10))
    engine.run()
    assert c.result.stats.reused_prompt_tokens == len(first) - 1
    assert c.result.token_ids == a.result.token_ids


def test_a_joining_prompt_copies_a_live_sequences_prefix_with_its_hidden_states(tiny_target, eagle_head):
    """A prompt joining while another decodes copies the shared prefix's keys, values and (EAGLE) hidden states
    from that row; a drafter that reads other hidden states, or a decoder with reuse off, copies nothing."""
    engine = BatchEngine(tiny_target, max_batch=4)
    eagle = lambda: SpeculativeDecoder(tiny_target, EagleDrafter(tiny_target, eagle_head), k=3)  # noqa: E731
    d = eagle()
    a = engine.submit(d, d.request([*SHARED, 28, 29], max_new_tokens=30))
    for _ in range(3):
        engine.step()
    assert a in engine.running
    d2, d3 = eagle(), SpeculativeDecoder(tiny_target, NgramDrafter(), k=3, reuse_prefix=False)
    prompt = [*SHARED, 25]
    b = engine.submit(d2, d2.request(prompt, max_new_tokens=12))
    c = engine.submit(d3, d3.request(prompt, max_new_tokens=12))
    engine.step()  # b's prefill starts: it copies SHARED from a's row
    assert b.state.stats.reused_prompt_tokens == len(SHARED) and b.state.cache is not a.state.cache
    assert torch.equal(b.state.features.view()[: len(SHARED)], a.state.features.view()[: len(SHARED)])
    engine.run()
    assert c.result.stats.reused_prompt_tokens == 0
    want = lone(tiny_target, prompt, max_new_tokens=12).token_ids
    assert b.result.token_ids == want and c.result.token_ids == want


@pytest.mark.parametrize("rows_apart", [True, False])
def test_a_conversations_next_turn_adopts_its_own_kept_cache(tiny_target, rows_apart):
    """Finished sequences' caches are kept while their rows are free, so a conversation's next turn takes its own
    over though another finished after it; where the group's rows share one store of positions (llama.cpp's window,
    ``rows_apart`` False) only the last is kept. Outputs equal the lone decoder's either way."""
    engine = BatchEngine(tiny_target, max_batch=3)
    engine.group.rows_apart = rows_apart
    turns = {}
    for prompt in ([*SHARED, 20, 21], [2, 7, 8, 9, 10]):
        d = SpeculativeDecoder(tiny_target, NgramDrafter(), k=3)
        seq = engine.submit(d, d.request(prompt, max_new_tokens=8))
        engine.run()
        turns[prompt[0]] = [*prompt, *seq.result.token_ids]
    assert len(engine.kept) == (2 if rows_apart else 1)
    follow = [*turns[SHARED[0]], 14, 15]  # the first conversation's next turn
    d = SpeculativeDecoder(tiny_target, NgramDrafter(), k=3)
    seq = engine.submit(d, d.request(follow, max_new_tokens=8))
    engine.run()
    reused = seq.result.stats.reused_prompt_tokens
    assert reused == (len(turns[SHARED[0]]) - 1 if rows_apart else 0)  # all it cached (the last token was pending)
    assert seq.result.token_ids == lone(tiny_target, follow, max_new_tokens=8).token_ids
    assert len(engine.group.rows) == len(engine.kept) <= 2


@pytest.mark.parametrize("prompt_cache_bytes", [0, 1 << 20])
def test_the_parked_cache_gives_its_row_to_a_prompt_that_needs_it(tiny_target, prompt_cache_bytes):
    """With one row, a prompt sharing nothing with the parked cache gets the row; the parked cache is copied out of
    it first (``prompt_cache_bytes``), so a later prompt with its prefix still takes it (0: dropped, prefilled)."""
    engine = BatchEngine(tiny_target, max_batch=1, prompt_cache_bytes=prompt_cache_bytes)
    for prompt in ([*SHARED, 20], [2, 7, 8, 9], [*SHARED, 21]):
        d = SpeculativeDecoder(tiny_target, NgramDrafter(), k=3)
        seq = engine.submit(d, d.request(prompt, max_new_tokens=6))
        engine.run()
        assert seq.error is None and seq.result.token_ids == lone(tiny_target, prompt, max_new_tokens=6).token_ids
        assert len(engine.group.rows) == 1
    # the parked cache was [2, 7, 8, 9]'s; the first prompt's, copied out, shares SHARED with the third
    assert seq.result.stats.reused_prompt_tokens == (len(SHARED) if prompt_cache_bytes else 0)
    assert len(engine.stored) == (2 if prompt_cache_bytes else 0)
    assert sum(x.nbytes for x in engine.stored) <= prompt_cache_bytes


def test_copied_out_caches_keep_within_their_budget(tiny_target):
    """The oldest copies are dropped first once the copies exceed ``prompt_cache_bytes``."""
    engine = BatchEngine(tiny_target, max_batch=1, prompt_cache_bytes=1 << 20)
    prompts = [[*SHARED, 20], [2, 7, 8, 9], [5, 6, 7, 8, 9, 10, 11]]
    for prompt in prompts:
        d = SpeculativeDecoder(tiny_target)
        engine.submit(d, d.request(prompt, max_new_tokens=6))
        engine.run()
    sizes = [x.nbytes for x in engine.stored]
    assert len(sizes) == 2 and min(sizes) > 0
    engine.prompt_cache_bytes = max(sizes)  # the first prompt's copy (the largest): the next copy pushes it out
    d = SpeculativeDecoder(tiny_target)
    engine.submit(d, d.request([29, 30, 31], max_new_tokens=4))
    engine.run()
    assert [x.tokens[0] for x in engine.stored] == [2, 5]  # the third prompt's copied out when the fourth came
    assert sum(x.nbytes for x in engine.stored) <= engine.prompt_cache_bytes


def test_copy_prefix_checks_its_rows(tiny_target):
    group = tiny_target.new_kv_group(3)
    a, b = group.new_kv(), group.new_kv()
    tiny_target.forward_batch([(a, [1, 2, 3, 4])])
    with pytest.raises(ValueError, match="cannot copy 5"):
        group.copy_prefix(a, b, 5)
    group.copy_prefix(a, b, 3)
    assert len(b) == 3
    with pytest.raises(ValueError, match="already holds 3"):
        group.copy_prefix(a, b, 2)
    ref = tiny_target.forward_batch([(a, [9])])[0].logits
    a.truncate(3)
    assert torch.allclose(tiny_target.forward_batch([(b, [4, 9])])[0].logits[-1], ref[-1], atol=1e-5)


def test_batch_passes_beside_a_loading_program_are_not_costs_and_the_curve_follows_the_program():
    """A pass timed while a program loads in the background shared the cores with the loader: the batch engine
    does not observe it; once the program is in, its passes go into the curve of the passes as they run now."""
    from verispec.controller import shared_cost_curve

    target = loaded(make_model(seed=21))  # a model of its own: no curve from another test
    now = {"loading": True}

    class Loading(type(target)):
        @property
        def programs_loading(self):
            return now["loading"]

        @property
        def cost_state(self):
            return "loading" if now["loading"] else "in"

    target.__class__ = Loading
    try:
        engine = BatchEngine(target, max_batch=2)
        decoders = [SpeculativeDecoder(target, NgramDrafter(), k=3) for _ in range(2)]
        seqs = [engine.submit(d, d.request(p, max_new_tokens=8)) for d, p in zip(decoders, PROMPTS)]
        for _ in range(3):
            engine.step()
        before = shared_cost_curve(target)
        assert not before.measured()
        now["loading"] = False
        while engine.busy:
            engine.step()
        after = shared_cost_curve(target)
        assert after is not before and after.measured() and engine.costs is after and not before.measured()
        assert all(seq.error is None for seq in seqs)
    finally:
        target.__class__ = Loading.__mro__[1]
