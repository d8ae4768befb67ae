"""The EAGLE head and drafter on tiny random models: training/inference alignment, rollback, greedy identity,
exact sampling distribution, checkpoints bound to their target, and the train-eagle pipeline end to end."""

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest
import safetensors.torch
import torch

from statistical_helpers import ALPHA, SAMPLES, exact_joint, joint_p_value, sampled_joint
from tiny import loaded, make_model
from verispec import EagleDrafter, IncompatibleDrafter, ModelNotFound, SamplingParams, SpeculativeDecoder
from verispec.errors import InvalidRequest
from verispec.audit import chi_square
from verispec.drafters.base import Draft
from verispec.training.data import Sequence, build_dataset, load_meta, load_sequences
from verispec.eagle.head import EagleHead, HeadCache, head_config_for, ttt_mask
from verispec.eagle.train import (TrainConfig, collate, draft_vocabulary, unrolled_states,
                                  validation_split)
from verispec.hidden_states import FeatureBuffer

LAYERS = (1, 2)  # the tiny target has 2 layers: hidden_states 0 (embeddings), 1, 2 (final, normed)
PROMPTS = [[5, 9, 3, 5, 9, 4, 7], [3, 4, 5, 6, 7, 8, 9, 10, 3, 4, 5], [12, 30, 7]]


def random_head(target, vocab=None, seed=0):
    torch.manual_seed(seed)
    vocab = vocab or target.vocab_size
    head = EagleHead(head_config_for(target.model, target.name, list(LAYERS), vocab))
    head.d2t.copy_(torch.arange(target.vocab_size)[torch.randperm(target.vocab_size)[:vocab]].sort().values)
    return head.attach(target.model).eval()


def features_of(target, ids):
    with torch.no_grad():
        out = target.model(torch.tensor([ids]), output_hidden_states=True)
    return torch.stack([out.hidden_states[i][0] for i in LAYERS], dim=1)  # [n, L, H]


@pytest.fixture(scope="module")
def trained_head_dir(tmp_path_factory, small_target):
    """A head trained by the real pipeline on the tiny target's own answers (seconds on CPU)."""
    root = tmp_path_factory.mktemp("eagle")
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 32) for _ in range(rng.randrange(3, 12))] for _ in range(400)]
    build_dataset(small_target, prompts, root / "data", layers=LAYERS, max_new_tokens=24, batch_size=64,
                  shard_size=64, progress=False)
    from verispec.eagle.train import train_head

    config = TrainConfig(epochs=20, lr=3e-3, warmup_steps=5, batch_tokens=2048, draft_vocab_size=28, val_sequences=16,
                         val_every=40, bf16_autocast=False)
    report = train_head(small_target, root / "data", root / "head", config, progress=False, log=lambda m: None)
    return root / "head", report


def test_feature_buffer_appends_truncates_and_grows():
    buf = FeatureBuffer()
    rows = torch.arange(600 * 2 * 3, dtype=torch.float32).view(600, 2, 3)
    buf.append(rows[:5])
    buf.append(rows[5:300])  # grows past the first capacity
    assert len(buf) == 300 and torch.equal(buf.view(), rows[:300])
    buf.truncate(7)
    buf.append(rows[7:600])
    assert torch.equal(buf.view(), rows)
    with pytest.raises(ValueError):
        buf.truncate(601)


def test_feature_buffer_skips_a_prompts_first_positions():
    """Positions prefilled without hidden states: ``view`` holds the rows after them only, rows recorded before a
    skip are dropped with it (no gap), truncating into the skipped part moves the start back, and a buffer joining a
    cached prefix takes the donor's start."""
    rows = torch.arange(40 * 2 * 3, dtype=torch.float32).view(40, 2, 3)
    buf = FeatureBuffer()
    buf.skip(10)
    buf.append(rows[10:15])
    assert (len(buf), buf.start) == (15, 10) and torch.equal(buf.view(), rows[10:15])
    buf.append(rows[15:30])  # a second append after the skipped part
    assert torch.equal(buf.view(), rows[10:30])
    buf.truncate(12)
    assert torch.equal(buf.view(), rows[10:12])
    joined = FeatureBuffer()
    joined.extend_from(buf, 11)
    assert (len(joined), joined.start) == (11, 10) and torch.equal(joined.view(), rows[10:11])
    buf.truncate(4)  # back into the skipped positions: no rows left; the next ones start at 4
    buf.append(rows[4:9])
    assert buf.start == 4 and torch.equal(buf.view(), rows[4:9])
    buf.skip(3)  # after recorded rows: they go too, so the rows seen stay the last positions'
    buf.append(rows[12:14])
    assert (len(buf), buf.start) == (14, 12) and torch.equal(buf.view(), rows[12:14])
    with pytest.raises(ValueError, match="empty"):
        buf.extend_from(joined, 3)


def test_a_head_reading_a_prompts_last_rows_drafts_as_if_the_prompt_began_there(small_target):
    """With the features of the last positions only, the head starts its cache at the first of them: its rotary
    positions count from there, and since attention sees only their differences it drafts exactly what a head
    given the prompt from that position on drafts; the next proposal reads on from that origin."""
    ids = [5, 9, 3, 5, 9, 4, 7, 11, 3, 8, 14, 2, 6]
    feats = features_of(small_target, ids)
    m, first = len(ids) - 1, 7
    late = EagleDrafter(small_target, random_head(small_target, 20), context_vocab=False, prompt_rows=m - first)
    fresh = EagleDrafter(small_target, random_head(small_target, 20), context_vocab=False)
    a = late.propose(ids, 4, features=feats[first:m])
    b = fresh.propose(ids[first:], 4, features=feats[first:m])
    assert a.tokens == b.tokens and late._origin == first and len(late._cache) == m - first
    more = ids + [9, 9]  # two tokens committed: the head reads their pairs on from its origin
    longer = features_of(small_target, more)
    assert late.propose(more, 4, features=longer[first : len(more) - 1]).tokens == \
        fresh.propose(more[first:], 4, features=longer[first : len(more) - 1]).tokens
    assert late._origin == first
    # a context that differs before the origin: the cached pairs are dropped and the head starts at the new rows
    other = [7] + more[1:]
    late.propose(other, 2, features=longer[10 : len(more) - 1])
    assert late._origin == 10 and len(late._cache) == len(more) - 1 - 10
    assert late.propose(other, 2, features=longer[:0]).tokens == []  # no rows at all: nothing to draft from
    with pytest.raises(InvalidRequest, match="prompt rows"):
        EagleDrafter(small_target, random_head(small_target, 20), prompt_rows=0)
    assert EagleDrafter(small_target, random_head(small_target, 20)).prompt_feature_rows is None  # transformers: all


def test_greedy_output_is_plain_with_a_prompt_read_from_its_last_rows(small_target, trained_head_dir):
    """The engine prefills the prompt without hidden states but for the head's last rows (a forward of its own,
    asking for none), keeps the skipped positions' place in the feature buffer, and decodes plain greedy tokens;
    a second request sharing the prompt's prefix reuses the cache."""
    calls = []
    forward = small_target.forward

    def recording(kv, tokens, **kwargs):
        calls.append((len(tokens), tuple(kwargs.get("feature_layers") or ())))
        return forward(kv, tokens, **kwargs)

    drafter = EagleDrafter(small_target, trained_head_dir[0], prompt_rows=3)
    decoder = SpeculativeDecoder(small_target, drafter, k=3, k_policy="fixed")
    prompt = PROMPTS[1]
    small_target.forward = recording
    try:
        got = decoder.generate(prompt, max_new_tokens=30)
    finally:
        del small_target.forward
    assert calls[:2] == [(len(prompt) - 1 - 3, ()), (3, LAYERS)]  # the blind part, then the head's rows
    assert drafter._origin == len(prompt) - 1 - 3 and got.stats.accepted > 0
    assert got.token_ids == SpeculativeDecoder(small_target).generate(prompt, max_new_tokens=30).token_ids
    again = decoder.generate(prompt[:-1] + [12, 30, 7], max_new_tokens=20)
    assert again.stats.reused_prompt_tokens > 0
    assert again.token_ids == SpeculativeDecoder(small_target).generate(prompt[:-1] + [12, 30, 7],
                                                                        max_new_tokens=20).token_ids
    # the batch engine prefills in chunks of 2 tokens that straddle the head's first row, beside a plain sequence
    from verispec.batching import BatchEngine

    engine = BatchEngine(small_target, max_batch=2, prefill_chunk=2)
    heads = SpeculativeDecoder(small_target, EagleDrafter(small_target, trained_head_dir[0], prompt_rows=3), k=3,
                               k_policy="fixed")
    other = SpeculativeDecoder(small_target)
    seqs = [engine.submit(d, d.request(p, max_new_tokens=30)) for d, p in ((other, PROMPTS[0]), (heads, prompt))]
    while engine.busy:
        engine.step()
    assert seqs[1].result.token_ids == got.token_ids and seqs[1].result.stats.drafted > 0
    assert heads.drafter._origin == len(prompt) - 1 - 3


def test_ttt_mask_is_the_drafters_view():
    m = ttt_mask(5, 2)  # keys: [step0 0..4 | step1 0..4 | step2 0..4]
    # query at position 4, depth 2: true keys 0..2, its depth-1 key at 3, its own depth-2 key at 4
    assert m[4].nonzero().flatten().tolist() == [0, 1, 2, 5 + 3, 10 + 4]
    assert ttt_mask(4, 0).equal(torch.ones(4, 4, dtype=torch.bool).tril())


def test_incremental_steps_equal_one_wide_step(small_target):
    head = random_head(small_target)
    ids = PROMPTS[1]
    feats = head.fuse_features(features_of(small_target, ids))
    tokens = torch.tensor(ids[1:])
    with torch.no_grad():
        wide = head.step(tokens, feats[:-1], HeadCache())
        cache = HeadCache()
        narrow = torch.cat([head.step(tokens[i : i + 1], feats[i : i + 1], cache) for i in range(len(tokens))])
        cache.truncate(4)  # rollback, then refeed: same result
        again = torch.cat([head.step(tokens[4:6], feats[4:6], cache), head.step(tokens[6:], feats[6:-1], cache)])
    assert torch.allclose(wide, narrow, atol=1e-5)
    assert torch.allclose(wide[4:], again, atol=1e-5)


def test_training_unroll_matches_what_the_drafter_computes(small_target):
    """Depth s of the training-time unroll at position i is exactly the drafter's g at draft depth s (with the
    drafted tokens equal to the sequence's): training optimises what inference runs."""
    head = random_head(small_target)
    ids = [5, 9, 3, 5, 9, 4, 7, 11, 12, 3, 8, 20]
    hidden = features_of(small_target, ids).bfloat16().float()  # training data stores features in bfloat16
    from verispec.training.data import Sequence as Seq

    batch = collate([Seq(torch.tensor(ids), 3, torch.cat([hidden, hidden[:, -1:]], dim=1))])
    with torch.no_grad():
        depth = unrolled_states(head, batch, 3)  # each [1, T-1, H]
        for m in (3, 6, 8):  # pending token at position m: true pairs 0..m-1
            cache = HeadCache()
            g = head.step(torch.tensor(ids[1 : m + 1]), head.fuse_features(hidden[:m]), cache)[-1]
            assert torch.allclose(g, depth[0][0, m - 1], atol=1e-5)
            for s in (1, 2):  # feed the head's own output with the sequence's next token
                g = head.step(torch.tensor([ids[m + s]]), g[None], cache)[-1]
                assert torch.allclose(g, depth[s][0, m - 1 + s], atol=1e-5), (m, s)


@pytest.mark.parametrize("k", [1, 2, 3, 5, 8])
def test_eagle_greedy_equals_plain_greedy(small_target, trained_head_dir, k):
    heads = [EagleDrafter(small_target, trained_head_dir[0], precision="float32"),
             EagleDrafter(small_target, trained_head_dir[0], precision="bfloat16"),
             EagleDrafter(small_target, random_head(small_target, 20))]
    assert heads[1].head.fc.weight.dtype == torch.bfloat16 and heads[0].head.fc.weight.dtype == torch.float32
    for prompt in PROMPTS:
        expected = SpeculativeDecoder(small_target).generate(prompt, max_new_tokens=40).token_ids
        for drafter in heads:
            got = SpeculativeDecoder(small_target, drafter, k=k, k_policy="fixed").generate(prompt, max_new_tokens=40)
            assert got.token_ids == expected, (k, prompt)


def test_an_eagle_chain_stops_where_the_controller_says_and_keeps_the_output(small_target, trained_head_dir):
    """A chain asks the controller after each token whether another pays (``stops_early``); its drafts end short of
    the budget at several lengths and greedy output is plain decoding's. A tree spends its node budget whole."""
    from test_controller import FixedCosts  # a given cost curve: what the controller decides does not follow the host

    drafter = EagleDrafter(small_target, trained_head_dir[0], precision="float32")
    assert drafter.stops_early and not EagleDrafter(small_target, trained_head_dir[0], tree=True).stops_early
    asked, real = [], drafter.propose

    def spy(context, k, features=None, enough=None):
        draft = real(context, k, features=features, enough=enough)
        asked.append((k, len(draft), enough is not None))
        return draft

    drafter.propose = spy
    decoder = SpeculativeDecoder(small_target, drafter, k=6)
    decoder.controller.costs = FixedCosts(0.1, base=0.02)  # a pass costs far more than a head step, not 50 times
    for prompt in PROMPTS:
        expected = SpeculativeDecoder(small_target).generate(prompt, max_new_tokens=40).token_ids
        assert decoder.generate(prompt, max_new_tokens=40).token_ids == expected, prompt
    opened = [(k, n) for k, n, rule in asked if rule]
    assert opened and max(k for k, _ in opened) == 6
    assert len({n for _, n in opened}) >= 2 and any(n < k for k, n in opened), asked


def counting_sources(drafter: EagleDrafter) -> dict[str, int]:
    """Count the proposals an ``eagle+suffix`` drafter took from the suffix store and from its head."""
    counts = {"suffix": 0, "head": 0}
    suffix_propose, head_step = drafter._suffix.propose, drafter.steps.step_logits

    def from_store(context, k):
        draft = suffix_propose(context, k)
        counts["suffix"] += bool(len(draft))
        return draft

    def from_head(*args, **kwargs):
        counts["head"] += 1
        return head_step(*args, **kwargs)

    drafter._suffix.propose, drafter.steps = from_store, type("Steps", (), {"step_logits": staticmethod(from_head)})
    return counts


@pytest.mark.parametrize("k", [1, 3, 8])
def test_eagle_with_suffix_drafts_greedy_equals_plain_greedy(small_target, trained_head_dir, k):
    drafter = EagleDrafter(small_target, trained_head_dir[0], suffix=True)
    drafter.isolate()  # this test's text only, not the process's
    assert drafter.name == "eagle+suffix"
    counts = counting_sources(drafter)
    for prompt in PROMPTS:
        expected = SpeculativeDecoder(small_target).generate(prompt, max_new_tokens=40).token_ids
        got = SpeculativeDecoder(small_target, drafter, k=k, k_policy="fixed").generate(prompt, max_new_tokens=40)
        assert got.token_ids == expected, (k, prompt)
    assert counts["suffix"] > 0 and counts["head"] > 0, counts  # both sources drafted


def test_eagle_with_suffix_drafts_when_sampling_asks_the_head_only(small_target, trained_head_dir):
    """When sampling every step asks the head (copies are accepted less than the head's sampled drafts); the
    committed tokens follow the target exactly."""
    drafter = EagleDrafter(small_target, trained_head_dir[0], suffix=True)
    drafter.isolate()
    counts = counting_sources(drafter)
    decoder = SpeculativeDecoder(small_target, drafter, k=3, k_policy="fixed")
    assert joint_p_value(decoder, EAGLE_SAMPLING["t0.3"]) > ALPHA
    assert counts["suffix"] == 0 and counts["head"] > 0, counts
    decoder.generate(PROMPTS[1], max_new_tokens=30)  # greedy again: the store drafts
    assert counts["suffix"] > 0, counts
    with pytest.raises(ValueError, match="lookup"):
        EagleDrafter(small_target, trained_head_dir[0], suffix=True, tree=True)


def test_trained_head_drafts_tokens_the_target_accepts(small_target, trained_head_dir):
    head_dir, report = trained_head_dir
    decoder = SpeculativeDecoder(small_target, EagleDrafter(small_target, head_dir), k=4, k_policy="fixed")
    untrained = SpeculativeDecoder(small_target, EagleDrafter(small_target, random_head(small_target)), k=4, k_policy="fixed")
    trained_mat = sum(decoder.generate(p, max_new_tokens=40).stats.mean_accepted_tokens for p in PROMPTS)
    random_mat = sum(untrained.generate(p, max_new_tokens=40).stats.mean_accepted_tokens for p in PROMPTS)
    assert trained_mat / 3 > 2.0 and trained_mat > random_mat + 1.5
    first, best = report.val_history[0], report.best
    assert best["top1"][0] > 0.5 and best["top1"][0] > first["top1"][0]
    assert all(0 <= b <= 1 for b in best["beta"])


def test_prefix_reuse_keeps_features_in_step(small_target, trained_head_dir):
    decoder = SpeculativeDecoder(small_target, EagleDrafter(small_target, trained_head_dir[0]), k=4, k_policy="fixed", reuse_prefix=True)
    for prompt in (PROMPTS[1], PROMPTS[1] + [7, 7], PROMPTS[1][:6], PROMPTS[0]):
        got = decoder.generate(prompt, max_new_tokens=30)
        assert got.token_ids == SpeculativeDecoder(small_target).generate(prompt, max_new_tokens=30).token_ids
    assert got.stats.accepted > 0


# the small target's logits are small, so it is sampled at a low temperature to give the test many cells
EAGLE_SAMPLING = {
    "t0.3": SamplingParams(temperature=0.3),
    "topk-topp": SamplingParams(temperature=0.3, top_k=8, top_p=0.9),
}


# each sampling case once and each precision once (the four pairs cost 30-46 s apiece on a loaded core): the precision
# changes q's values, not how they are sampled and tested
@pytest.mark.parametrize("case, precision", [("t0.3", "float32"), ("topk-topp", "bfloat16")])
def test_eagle_sampling_matches_exact_joint_distribution(small_target, trained_head_dir, case, precision):
    """q is the head's distribution over a 28-token draft vocabulary (zero elsewhere), computed in float32 or by a
    bfloat16 head under the float32 target; the committed tokens still follow the target exactly."""
    drafter = EagleDrafter(small_target, trained_head_dir[0], precision=precision)
    decoder = SpeculativeDecoder(small_target, drafter, k=3, k_policy="fixed")
    assert joint_p_value(decoder, EAGLE_SAMPLING[case]) > ALPHA
    assert drafter.head.lm_head_d.dtype == getattr(torch, precision)


def test_head_precision_auto_is_bfloat16_only_where_the_cpu_multiplies_it_natively(small_target, trained_head_dir,
                                                                               monkeypatch):
    from verispec.backends.torch_cpu import cpu
    from verispec.drafters import precision as head_precision

    native = cpu.bfloat16_dot_products()
    expected = torch.bfloat16 if native else torch.float32
    assert EagleDrafter(small_target, trained_head_dir[0]).head.fc.weight.dtype == expected
    monkeypatch.setattr(cpu, "bfloat16_dot_products", lambda: False)
    assert head_precision.head_dtype("auto", small_target) == torch.float32
    monkeypatch.setattr(cpu, "bfloat16_dot_products", lambda: True)
    assert head_precision.head_dtype("auto", small_target) == torch.bfloat16
    assert head_precision.head_dtype("float32", small_target) == torch.float32
    bf16_target = loaded(make_model(seed=0, scale=0.1).to(torch.bfloat16), small_target.tokenizer)
    bf16_target.dtype = torch.bfloat16
    assert head_precision.head_dtype("auto", bf16_target) == torch.bfloat16  # the target's own dtype
    with pytest.raises(InvalidRequest, match="head precision must be one of auto, float32, bfloat16, got 'float16'"):
        EagleDrafter(small_target, trained_head_dir[0], precision="float16")


def test_a_head_converted_to_another_precision_leaves_the_targets_embedding_alone(tiny_target):
    """The head borrows the target's embedding without owning it: converting an attached head (an explicit
    precision on a caller's head) must not convert the target's embedding in place, which changed its decoding."""
    embedding = tiny_target.embedding_model.get_input_embeddings().weight
    before = embedding.detach().clone()
    head = random_head(tiny_target, 20)
    drafter = EagleDrafter(tiny_target, head, precision="bfloat16")
    assert drafter.head.fc.weight.dtype == torch.bfloat16 and drafter.head.embed is not None
    assert "embed" not in dict(head.named_children()) and not any(n.startswith("embed.") for n in head.state_dict())
    weight = tiny_target.embedding_model.get_input_embeddings().weight
    assert weight.dtype == torch.float32 and torch.equal(weight, before)


def test_eagle_sampling_at_temperature_1_with_an_untrained_head(tiny_target):
    """Mostly rejected drafts: the correction token comes from norm(max(p - q, 0)) nearly every step."""
    decoder = SpeculativeDecoder(tiny_target, EagleDrafter(tiny_target, random_head(tiny_target, 20)), k=3, k_policy="fixed")
    assert joint_p_value(decoder, SamplingParams(temperature=1.0)) > ALPHA


@pytest.mark.parametrize("case", EAGLE_SAMPLING)
def test_eagle_trees_when_sampling_match_exact_joint_distribution(small_target, trained_head_dir, case):
    """The head's dynamic tree (deterministic nodes) at temperature 0.3, with and without top-k / top-p, verified
    by the one-hot tree rule: the committed tokens follow the target exactly, and trees were really drafted."""
    drafter = EagleDrafter(small_target, trained_head_dir[0], tree=True, depth=3, width=2)
    decoder = SpeculativeDecoder(small_target, drafter, k=6, k_policy="fixed")
    assert joint_p_value(decoder, EAGLE_SAMPLING[case]) > ALPHA
    out = decoder.generate(PROMPTS[0], max_new_tokens=20, seed=1, temperature=EAGLE_SAMPLING[case].temperature)
    assert out.stats.drafted > 0 and max(out.stats.step_drafted) >= 2 and out.stats.accepted > 0


def test_lossy_typical_acceptance_with_eagle_fails_the_exact_test(small_target, trained_head_dir):
    decoder = SpeculativeDecoder(small_target, EagleDrafter(small_target, trained_head_dir[0]), k=3, k_policy="fixed",
                                 acceptance="typical")
    sampling = SamplingParams(temperature=0.3)
    prompt = PROMPTS[0]
    observed = sampled_joint(decoder, prompt, sampling)
    _, _, p_value, _ = chi_square(observed, exact_joint(small_target, prompt, sampling) * SAMPLES)
    assert p_value < 1e-6


def test_head_checkpoint_roundtrip_and_wrong_target(small_target, trained_head_dir, tmp_path):
    head_dir = trained_head_dir[0]
    cfg = json.loads((head_dir / "config.json").read_text())
    assert cfg["target"] == small_target.name and cfg["feature_layers"] == list(LAYERS)
    assert cfg["draft_vocab_size"] == 28 and cfg["training"]["best_validation"]["top1"]
    head = EagleHead.load(head_dir)
    assert head.d2t.tolist() == sorted(head.d2t.tolist()) and len(set(head.d2t.tolist())) == 28
    other = loaded(make_model(seed=7), small_target.tokenizer, name="tiny-other")
    with pytest.raises(IncompatibleDrafter, match="trained for 'tiny'.*train-eagle"):
        EagleDrafter(other, head_dir)
    with pytest.raises(ModelNotFound, match="does not exist"):
        EagleDrafter(small_target, tmp_path / "missing")
    with pytest.raises(ModelNotFound, match="no EAGLE head ships for target 'tiny'"):
        EagleDrafter(small_target)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFound, match="not an EAGLE head"):
        EagleDrafter(small_target, tmp_path / "empty")


def test_bfloat16_target_and_head_run(small_target, trained_head_dir):
    model = make_model(seed=0, scale=0.1).to(torch.bfloat16)
    target = loaded(model, small_target.tokenizer)
    target.dtype = torch.bfloat16
    out = SpeculativeDecoder(target, EagleDrafter(target, trained_head_dir[0]), k=4, k_policy="fixed").generate(PROMPTS[0],
                                                                                             max_new_tokens=30)
    assert out.stats.new_tokens == 30 and out.stats.drafted > 0
    assert EagleDrafter(target, trained_head_dir[0]).head.fc.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_is_packed_where_the_cpu_can_with_the_same_logits_and_saves_unchanged(small_target, trained_head_dir,
                                                                                   tmp_path, dtype):
    from verispec.backends.torch_cpu.packing import PackedLinear, packing_available

    if not packing_available(dtype):
        pytest.skip(f"this CPU cannot run oneDNN's packed {dtype} kernel (tests/test_packing.py covers the fallback)")
    model = make_model(seed=0, scale=0.1).to(dtype)
    head = EagleHead.load(trained_head_dir[0], dtype=dtype).attach(model)
    plain = EagleHead.load(trained_head_dir[0], dtype=dtype).train().attach(model).eval()  # not packed
    assert isinstance(head.fc, PackedLinear) and not isinstance(plain.fc, PackedLinear)
    assert head._lm_head_packed is not None and plain._lm_head_packed is None
    # bfloat16: the packed op is bit-identical; float32: within the last bits of MKL's result
    same = torch.equal if dtype == torch.bfloat16 else lambda a, b: torch.allclose(a, b, rtol=1e-4, atol=1e-5)
    g = torch.randn(5, 32, dtype=dtype)
    with torch.inference_mode():
        assert same(head.logits(g), plain.logits(g))
        tokens, feats = torch.tensor([4, 5, 6]), torch.randn(3, 32, dtype=dtype)
        assert same(head.step(tokens, feats, HeadCache()), plain.step(tokens, feats, HeadCache()))
    head.save(tmp_path / "again")
    saved = safetensors.torch.load_file(tmp_path / "again" / "model.safetensors")
    assert saved.keys() == safetensors.torch.load_file(Path(trained_head_dir[0]) / "model.safetensors").keys()


def test_dataset_is_resumable_and_refuses_other_settings(small_target, tmp_path):
    prompts = [[5, 9, 3], [4, 4, 4, 4], [7, 8]]
    build_dataset(small_target, prompts, tmp_path, layers=LAYERS, max_new_tokens=5, batch_size=2, shard_size=2,
                  progress=False)
    seqs = list(load_sequences(tmp_path))
    assert [s.tokens[: s.answer_start].tolist() for s in seqs] == [[5, 9, 3], [4, 4, 4, 4], [7, 8]] or \
        sorted(len(s.tokens) - s.answer_start for s in seqs) == [5, 5, 5]
    assert all(s.features.shape == (len(s.tokens), 3, 32) for s in seqs)
    # the answers are the target's own greedy continuations
    for s in seqs:
        prompt = s.tokens[: s.answer_start].tolist()
        expected = SpeculativeDecoder(small_target).generate(prompt, max_new_tokens=5).token_ids
        assert s.tokens[s.answer_start:].tolist() == expected
    first = (tmp_path / "shard-00000.safetensors").stat().st_mtime_ns
    build_dataset(small_target, prompts, tmp_path, layers=LAYERS, max_new_tokens=5, batch_size=2, shard_size=2,
                  progress=False)
    assert (tmp_path / "shard-00000.safetensors").stat().st_mtime_ns == first  # kept, not rebuilt
    assert load_meta(tmp_path)["layers"] == list(LAYERS)
    from verispec import InvalidRequest

    with pytest.raises(InvalidRequest, match="max_new_tokens"):
        build_dataset(small_target, prompts, tmp_path, layers=LAYERS, max_new_tokens=6, shard_size=2, progress=False)
    # Medusa asks for no layers (the final state only): EAGLE's data serves, extended with EAGLE's layers
    build_dataset(small_target, prompts + [[6, 6]], tmp_path, layers=(), max_new_tokens=5, batch_size=2,
                  shard_size=2, progress=False)
    assert (tmp_path / "shard-00000.safetensors").stat().st_mtime_ns == first
    assert load_meta(tmp_path)["layers"] == list(LAYERS)
    assert all(s.features.shape == (len(s.tokens), 3, 32) for s in load_sequences(tmp_path))
    assert len(list(load_sequences(tmp_path))) == 4
    with pytest.raises(InvalidRequest, match="layers"):
        build_dataset(small_target, prompts, tmp_path, layers=(0,), max_new_tokens=5, shard_size=2, progress=False)


def test_sampled_answers_follow_the_target_and_extend_greedy_data(small_target, tmp_path):
    prompts = [[5, 9, 3], [4, 4, 4, 4], [7, 8]]
    build_dataset(small_target, prompts, tmp_path, layers=(), max_new_tokens=5, batch_size=2, shard_size=2,
                  progress=False, features=False)
    first = (tmp_path / "shard-00000.safetensors").stat().st_mtime_ns
    # a second answer to each prompt, sampled: the greedy answers on disk stay, only the new ones are asked
    temps = [0.0] * 3 + [1.0] * 3
    build_dataset(small_target, prompts * 2, tmp_path, layers=(), max_new_tokens=5, batch_size=2, shard_size=2,
                  progress=False, features=False, temperatures=temps, seed=4)
    assert (tmp_path / "shard-00000.safetensors").stat().st_mtime_ns == first
    seqs = list(load_sequences(tmp_path))
    assert len(seqs) == 6 and load_meta(tmp_path)["answer_temperatures"] == [0.0, 1.0]
    greedy = {tuple(p): SpeculativeDecoder(small_target).generate(p, max_new_tokens=5).token_ids for p in prompts}
    answers = [(tuple(s.tokens[: s.answer_start].tolist()), s.tokens[s.answer_start:].tolist()) for s in seqs]
    assert sorted(p for p, _ in answers) == sorted(tuple(p) for p in prompts * 2)
    assert sum(a == greedy[p] for p, a in answers) >= 3  # each prompt's greedy answer is there
    # seeded: the same call elsewhere writes the same sampled answers
    build_dataset(small_target, prompts * 2, tmp_path / "again", layers=(), max_new_tokens=5, batch_size=2,
                  shard_size=2, progress=False, features=False, temperatures=temps, seed=4)
    assert [s.tokens.tolist() for s in load_sequences(tmp_path / "again")] == [s.tokens.tolist() for s in seqs]
    # sampled from the target's whole distribution at the temperature (no top-k / top-p): a goodness-of-fit test
    prompt, n, temperature = [5, 9, 3], 3000, 0.7
    build_dataset(small_target, [prompt] * n, tmp_path / "dist", layers=(), max_new_tokens=1, batch_size=n,
                  shard_size=n, progress=False, features=False, temperatures=[temperature] * n)
    drawn = torch.tensor([int(s.tokens[-1]) for s in load_sequences(tmp_path / "dist")])
    with torch.no_grad():
        logits = small_target.model(torch.tensor([prompt])).logits[0, -1].float()
    expected = torch.softmax(logits / temperature, -1) * n
    observed = torch.bincount(drawn, minlength=expected.numel()).double()
    assert chi_square(observed, expected)[2] > ALPHA
    assert chi_square(observed, torch.softmax(logits, -1) * n)[2] < ALPHA  # the test can tell temperatures apart


def test_a_continued_run_that_trains_no_step_leaves_the_head_it_started_from(small_target, trained_head_dir, tmp_path):
    from verispec.eagle.train import train_head

    data = trained_head_dir[0].parent / "data"
    config = TrainConfig(epochs=1, batch_tokens=2048, val_sequences=16, bf16_autocast=False,
                         init_head=str(trained_head_dir[0]))
    report = train_head(small_target, data, tmp_path / "out", config, progress=False, log=lambda m: None,
                        should_stop=lambda step: True)
    assert report.steps == 0 and not report.finished
    start, kept = EagleHead.load(trained_head_dir[0]), EagleHead.load(tmp_path / "out")
    assert torch.equal(start.fc.weight, kept.fc.weight) and torch.equal(start.d2t, kept.d2t)
    assert report.best["step"] == 0 and report.best == report.val_history[0]


def test_a_head_transplanted_to_fewer_feature_layers_computes_what_the_whole_head_does_without_them(
        small_target, trained_head_dir):
    """--init-head with a subset of the head's --layers (the final state alone, for llama.cpp without a callback):
    the new head is the old one with the dropped layers' features set to zero (their norms give zero, so their
    fusion columns add nothing); a layer the old head never read is refused."""
    from verispec.eagle.train import transplant_feature_layers

    head = EagleHead.load(trained_head_dir[0])
    layers = list(head.config.feature_layers)
    final = small_target.model.config.num_hidden_layers
    assert len(layers) > 1 and layers[-1] == final
    small = transplant_feature_layers(head, [final])
    assert small.config.feature_layers == [final] and small.fuse.weight.shape[1] == head.config.hidden_size
    hidden = torch.randn(5, len(layers), head.config.hidden_size)
    only_final = hidden.clone()
    only_final[:, :-1] = 0
    with torch.no_grad():
        assert torch.allclose(small.fuse_features(hidden[:, -1:]), head.fuse_features(only_final), atol=1e-5)
        assert not torch.allclose(small.fuse_features(hidden[:, -1:]), head.fuse_features(hidden), atol=1e-3)
    assert torch.equal(small.fc.weight, head.fc.weight) and torch.equal(small.d2t, head.d2t)
    with pytest.raises(ValueError, match="subset"):
        transplant_feature_layers(head, [0, final])


def test_a_widened_head_starts_where_the_head_was_and_its_new_units_can_learn(small_target, trained_head_dir):
    """--intermediate-size with --init-head: the MLP gains units whose down-projection columns start at zero, so the
    widened head drafts exactly what the old one does; the new units' gate/up rows are not zero, so training moves
    them (the down columns get a gradient at once); narrowing is refused."""
    from verispec.eagle.train import widen_mlp

    head = EagleHead.load(trained_head_dir[0]).attach(small_target.model)
    old = head.config.intermediate_size
    wide = widen_mlp(head, old + 24).attach(small_target.model)
    assert wide.config.intermediate_size == old + 24 and wide.down_proj.weight.shape[1] == old + 24
    assert wide.gate_proj.weight[old:].abs().sum() > 0 and wide.up_proj.weight[old:].abs().sum() > 0
    n_feat = len(head.config.feature_layers)
    tokens = torch.tensor([3, 9, 4, 7, 1])
    features = head.fuse_features(torch.randn(5, n_feat, head.config.hidden_size))
    with torch.no_grad():
        g_old, logits_old = head.step_logits(tokens, features, HeadCache())
        g_new, logits_new = wide.step_logits(tokens, features, HeadCache())
    assert torch.allclose(g_old, g_new, atol=1e-5) and torch.allclose(logits_old, logits_new, atol=1e-4)
    wide.train()
    g, _ = wide.step_logits(tokens, features.detach(), HeadCache())
    g.square().sum().backward()
    assert wide.down_proj.weight.grad[:, old:].abs().sum() > 0
    with pytest.raises(ValueError, match="at least"):
        widen_mlp(head, old - 1)


def test_validation_split_holds_out_every_answer_to_a_prompt():
    rng = random.Random(5)
    prompts = [[rng.randrange(50) for _ in range(6)] for _ in range(40)]
    data = [Sequence(torch.tensor(p + [rng.randrange(50), 1]), 6, None) for p in prompts * 2]
    train, val = validation_split(data, 5)
    held = {tuple(s.tokens[:6].tolist()) for s in val}
    assert len(held) == 5 and len(val) == 10 and len(train) == 70
    assert not held & {tuple(s.tokens[:6].tolist()) for s in train}
    # with one answer per prompt the same prompts are held out (a head validated on greedy data stays comparable)
    assert {tuple(s.tokens[:6].tolist()) for s in validation_split(data[:40], 5)[1]} == held


def test_validation_split_is_stable_as_data_grows():
    rng = random.Random(3)
    data = [Sequence(torch.tensor([rng.randrange(50) for _ in range(rng.randrange(2, 8))] + [1, 2]), 2 + i % 3,
                     torch.zeros(1)) for i in range(300)]
    for s in data:
        s.answer_start = len(s.tokens) - 2
    small = data[:120]
    train_s, val_s = validation_split(small, 12)
    train_b, val_b = validation_split(list(reversed(data)), 12)  # more data, another order
    assert len(val_s) == 12 and len(train_s) == 108 and len(val_b) == 12 and len(train_b) == 288
    ids_small = {id(s) for s in small}
    # whatever the larger split holds out from the smaller set was held out there too (never trained on)
    assert {id(s) for s in val_b if id(s) in ids_small} <= {id(s) for s in val_s}
    assert {id(s) for s in val_s} != {id(s) for s in validation_split(small, 12, seed=1)[1]}


def test_draft_vocabulary_takes_the_most_frequent_answer_tokens():
    from verispec.training.data import Sequence as Seq

    seqs = [Seq(torch.tensor([1, 1, 5, 5, 5, 7]), 2, torch.zeros(6, 1, 1)),
            Seq(torch.tensor([9, 7, 5, 8]), 1, torch.zeros(4, 1, 1))]
    assert draft_vocabulary(seqs, 3, 32, {2}).tolist() == [2, 5, 7]
    assert draft_vocabulary(seqs, 5, 32, set()).tolist() == [0, 1, 5, 7, 8]  # padded with the lowest ids


@pytest.mark.parametrize("k", [2, 6, 12])
def test_eagle_tree_greedy_equals_plain_greedy(small_target, trained_head_dir, k):
    drafter = EagleDrafter(small_target, trained_head_dir[0], tree=True, depth=4, width=3)
    for prompt in PROMPTS:
        expected = SpeculativeDecoder(small_target).generate(prompt, max_new_tokens=40)
        tree_out = SpeculativeDecoder(small_target, drafter, k=k, k_policy="fixed").generate(prompt, max_new_tokens=40)
        assert tree_out.token_ids == expected.token_ids, (k, prompt)
        assert tree_out.stats.accepted > 0 and tree_out.stats.mean_accepted_tokens > 1.5


def test_eagle_tree_falls_back_to_a_chain_when_sampling(small_target, trained_head_dir):
    drafter = EagleDrafter(small_target, trained_head_dir[0], tree=True)
    out = SpeculativeDecoder(small_target, drafter, k=4, k_policy="fixed").generate(PROMPTS[0], max_new_tokens=20, temperature=0.5,
                                                                 seed=1)
    assert out.stats.new_tokens == 20 and out.stats.drafted > 0
    with pytest.raises(Exception, match="width must be"):
        EagleDrafter(small_target, trained_head_dir[0], tree=True, width=0)


def test_train_eagle_command_end_to_end(tiny_dir, tmp_path, capsys):
    """docs/eagle.md's training command on the tiny model: data, training, held-out check, then the head drafts."""
    from verispec.cli import main

    rng = random.Random(1)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": " ".join(f"w{rng.randrange(3, 32)}" for _ in range(6))}) + "\n"
                               for _ in range(50)))
    out = tmp_path / "head"
    code = main(["train-eagle", "--target", str(tiny_dir), "--prompts", str(prompts), "--out", str(out),
                 "--data", str(tmp_path / "data"), "--samples", "40", "--max-new-tokens", "8", "--epochs", "2",
                 "--draft-vocab", "16", "--val-every", "5", "--check-prompts", "2", "--layers", "1,2"])
    assert code == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["held_out_check"]["prompts"] == 2 and summary["best_validation"]["top1"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["training"]["held_out_check"] and cfg["training"]["data"]["sequences"] == 40
    assert main(["generate", "w5 w9 w3", "--raw", "--target", str(tiny_dir), "--drafter", "eagle", "--eagle-head",
                 str(out), "--max-new-tokens", "12", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["stats"]["drafter"] == "eagle" and result["stats"]["new_tokens"] >= 1

    # more data (the cached answers are kept, new ones added), then continue training that head
    # (and a second, sampled answer to each prompt: the 46 greedy answers are kept, 46 sampled ones added)
    more = tmp_path / "head-more"
    code = main(["train-eagle", "--target", str(tiny_dir), "--prompts", str(prompts), "--out", str(more),
                 "--data", str(tmp_path / "data"), "--samples", "46", "--max-new-tokens", "8", "--epochs", "1",
                 "--val-every", "5", "--check-prompts", "0", "--layers", "1,2", "--init-head", str(out),
                 "--answers-per-prompt", "2", "--answer-temperature", "0.9",
                 "--intermediate-size", str(cfg["intermediate_size"] + 16)])
    assert code == 0
    capsys.readouterr()
    assert json.loads((more / "config.json").read_text())["intermediate_size"] == cfg["intermediate_size"] + 16
    record = json.loads((more / "config.json").read_text())["training"]
    assert record["continued_from"]["intermediate_size"] == cfg["intermediate_size"]
    assert record["continued_from"]["head"] == str(out) and record["continued_from"]["training"]["data"]["sequences"] == 40
    assert record["data"]["sequences"] == 92 and len(list(load_sequences(tmp_path / "data"))) == 92
    assert record["data"]["answer_temperatures"] == [0.0, 0.9]
    prompts_on_disk = [tuple(s.tokens[: s.answer_start].tolist()) for s in load_sequences(tmp_path / "data")]
    assert all(prompts_on_disk.count(p) == 2 for p in prompts_on_disk)
    assert main(["train-eagle", "--target", str(tiny_dir), "--prompts", str(prompts), "--out", str(more),
                 "--answers-per-prompt", "2", "--answer-temperature", "0"]) != 0
    assert "--answer-temperature must be > 0" in capsys.readouterr().err
    assert record["config"]["init_head"] == str(out)
    assert record["validation_history"][0]["step"] == 0  # the continued head is validated before it trains
    first, second = EagleHead.load(out), EagleHead.load(more)
    assert torch.equal(first.d2t, second.d2t)  # the draft vocabulary is kept
    # the head written is the best validated one, the starting head included: never worse than where it started
    history = record["validation_history"]
    assert record["best_validation"]["est_tokens_per_step"] == max(m["est_tokens_per_step"] for m in history)
    assert len(history) >= 2 and torch.equal(first.fc.weight, second.fc.weight) == (record["best_validation"]["step"] == 0)
    assert main(["train-eagle", "--target", str(tiny_dir), "--prompts", str(prompts), "--out", str(more),
                 "--init-head", str(tmp_path / "nowhere")]) != 0
    assert "nowhere" in capsys.readouterr().err
    assert main(["train-eagle", "--target", str(tiny_dir), "--prompts", str(prompts), "--out", str(more),
                 "--init-head", str(out), "--intermediate-size", "1"]) != 0
    assert "widen it, not narrow it" in capsys.readouterr().err


def test_train_eagle_refuses_spec_bench_prompts_and_bad_options(tiny_dir, tmp_path, capsys):
    from verispec.bench.prompts import load_questions
    from verispec.cli import main

    question = load_questions()[0].turns[0]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "w5 w6"}) + "\n" + json.dumps({"prompt": question}) + "\n")
    assert main(["train-eagle", "--target", str(tiny_dir), "--prompts", str(prompts), "--out", str(tmp_path / "o")]) == 2
    assert "Spec-Bench questions" in capsys.readouterr().err
    assert main(["train-eagle", "--prompts", str(prompts), "--out", str(tmp_path / "o"), "--epochs", "0"]) == 2
    assert "--epochs must be >= 1" in capsys.readouterr().err
    assert main(["train-eagle", "--prompts", str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "o")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_bench_and_analyze_with_eagle_methods(small_dir, trained_head_dir, tmp_path, capsys):
    from verispec.cli import main

    head = trained_head_dir[0]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": i, "category": "writing", "turns": [t]}) + "\n"
                               for i, t in enumerate(["w5 w9 w3 w5 w9", "w12 w30 w7", "w3 w4 w5 w6"])))
    assert main(["bench", "--target", str(small_dir), "--prompts", str(prompts), "--max-new-tokens", "24",
                 "--methods", f"baseline,eagle:{head}:k=4,eagle:{head}:tree=1:k=8:depth=4:width=3",
                 "--k-policy", "fixed", "--out", str(tmp_path / "b"), "--no-plots"]) == 0
    overall = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["overall"]
    for name in (f"eagle:{head}:k=4", f"eagle:{head}:tree=1:k=8:depth=4:width=3"):
        assert overall[name]["identical"] == 1.0 and overall[name]["mean_accepted_tokens"] > 1.5, name
    assert main(["analyze", "--target", str(small_dir), "--prompts", str(prompts), "--drafter", f"eagle:{head}",
                 "--k-max", "4", "--max-new-tokens", "16", "--repeats", "1", "--out", str(tmp_path / "a")]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert 0.3 < result["teacher_forced_beta"] <= 1.0
    assert len(result["position_acceptance"]) == 4 and result["position_acceptance"][0] > 0.3
    assert main(["bench", "--target", str(small_dir), "--prompts", str(prompts), "--methods", "eagle:k=2:color=3"]) == 2
    assert "the eagle drafter has no option 'color'; its options: head, tree" in capsys.readouterr().err


def test_context_tokens_join_the_draft_vocabulary(small_target, trained_head_dir):
    head = random_head(small_target, vocab=4, seed=3)
    base = set(head.d2t.tolist())
    prompt = [t for t in range(3, 32) if t not in base][:6] * 2
    drafter = EagleDrafter(small_target, head)
    decoder = SpeculativeDecoder(small_target, drafter, k=4, k_policy="fixed")
    out = decoder.generate(prompt, max_new_tokens=20)
    assert out.token_ids == SpeculativeDecoder(small_target).generate(prompt, max_new_tokens=20).token_ids
    assert set(prompt) <= set(drafter.vocab.ids) and len(drafter.vocab.ids) == len(set(drafter.vocab.ids))
    closed = EagleDrafter(small_target, head, context_vocab=False)
    SpeculativeDecoder(small_target, closed, k=4, k_policy="fixed").generate(prompt, max_new_tokens=20)
    assert set(closed.vocab.ids) == base
    # sampled drafts over the grown vocabulary stay lossless (its q covers the context tokens)
    assert joint_p_value(SpeculativeDecoder(small_target, drafter, k=3, k_policy="fixed"), SamplingParams(temperature=0.3)) > ALPHA


def test_eagle_with_a_lookup_branch(small_target, trained_head_dir):
    from verispec.drafters.eagle import _merge_chain

    merged = _merge_chain(Draft([7, 8, 4], None, [-1, -1, 0]), [7, 4, 9])
    assert merged.tokens == [7, 8, 4, 9] and merged.parents == [-1, -1, 0, 2]
    drafter = EagleDrafter(small_target, trained_head_dir[0], tree=True, depth=3, width=2, lookup=True)
    assert drafter.name == "eagle+lookup"
    for prompt in (PROMPTS[1] * 2, PROMPTS[0]):
        expected = SpeculativeDecoder(small_target).generate(prompt, max_new_tokens=40).token_ids
        out = SpeculativeDecoder(small_target, drafter, k=10, k_policy="fixed").generate(prompt, max_new_tokens=40)
        assert out.token_ids == expected and out.stats.drafter == "eagle+lookup"
    with pytest.raises(Exception, match="needs tree mode"):
        EagleDrafter(small_target, trained_head_dir[0], lookup=True)


def test_token_only_data_trains_by_teacher_forcing_and_a_stopped_run_resumes_exactly(small_target, tmp_path):
    """--features online: the data holds tokens only and the target is run per batch; a run stopped after a step
    and resumed from checkpoint.pt ends with the same weights as one that never stopped."""
    from verispec.training import checkpoints as runs
    from verispec.eagle.train import train_head

    rng = random.Random(3)
    prompts = [[rng.randrange(3, 32) for _ in range(rng.randrange(3, 9))] for _ in range(40)]
    build_dataset(small_target, prompts, tmp_path / "data", layers=LAYERS, max_new_tokens=10, batch_size=16,
                  shard_size=16, progress=False, features=False)
    assert load_meta(tmp_path / "data")["features"] is False
    assert all(s.features is None for s in load_sequences(tmp_path / "data"))
    config = TrainConfig(epochs=3, lr=3e-3, warmup_steps=2, batch_tokens=128, draft_vocab_size=24, val_sequences=6,
                         val_every=3, bf16_autocast=False, feature_layers=list(LAYERS))
    whole = train_head(small_target, tmp_path / "data", tmp_path / "whole", config, progress=False, log=lambda m: None)
    assert whole.finished and whole.steps > 6 and whole.best["top1"][0] > 0
    assert EagleHead.load(tmp_path / "whole").config.feature_layers == list(LAYERS)

    first = train_head(small_target, tmp_path / "data", tmp_path / "split", config, progress=False, log=lambda m: None,
                       should_stop=lambda step: step >= 4)  # what Ctrl-C or SIGTERM does between steps
    assert not first.finished and first.steps == 4
    with pytest.raises(Exception, match="other settings"):
        train_head(small_target, tmp_path / "data", tmp_path / "split", replace(config, resume=True, lr=1e-3),
                   progress=False, log=lambda m: None)
    rest = train_head(small_target, tmp_path / "data", tmp_path / "split", replace(config, resume=True),
                      progress=False, log=lambda m: None)
    assert rest.finished and rest.steps == whole.steps and rest.train_tokens == whole.train_tokens
    a = torch.load(tmp_path / "whole" / runs.CHECKPOINT, weights_only=False)["weights"]
    b = torch.load(tmp_path / "split" / runs.CHECKPOINT, weights_only=False)["weights"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [m["top1"] for m in rest.val_history] == [m["top1"] for m in whole.val_history]


def test_train_eagle_online_features_with_a_time_limit(tiny_dir, tmp_path, capsys):
    from verispec.cli import main

    rng = random.Random(2)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": " ".join(f"w{rng.randrange(3, 32)}" for _ in range(5))}) + "\n"
                               for _ in range(30)))
    args = ["train-eagle", "--target", str(tiny_dir), "--prompts", str(prompts), "--out", str(tmp_path / "head"),
            "--data", str(tmp_path / "data"), "--samples", "24", "--max-new-tokens", "6", "--epochs", "2",
            "--draft-vocab", "16", "--val-every", "4", "--check-prompts", "0", "--features", "online",
            "--max-minutes", "5", "--batch-tokens", "128", "--val-sequences", "4"]
    assert main(args) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["finished"] and summary["trained_positions_per_second"] > 0
    assert load_meta(tmp_path / "data")["features"] is False
    assert EagleHead.load(tmp_path / "head").config.feature_layers == [2, 1, 0, 2]  # 2, L/2, L-2, L of L=2 layers
    assert main(args[:-4] + ["--device", "nosuchdevice"]) == 2
    assert "--device nosuchdevice" in capsys.readouterr().err
    assert main(args + ["--max-minutes", "0"]) == 2
    assert main(["train-eagle", "--target", str(tiny_dir), "--prompts", str(prompts), "--out", str(tmp_path / "new"),
                 "--resume"]) == 2
    assert "checkpoint.pt does not exist" in capsys.readouterr().err


def test_schedule_ends_on_steps_or_minutes_and_signals_stop_a_run_between_steps():
    import signal

    from verispec.training.checkpoints import Schedule, StopSignals
    from verispec.training.loop import cosine_lr

    steps = Schedule(1e-3, total=100, warmup=10)
    assert [steps.lr(s) for s in (0, 9, 10, 55, 99)] == [cosine_lr(s, 100, 10, 1e-3) for s in (0, 9, 10, 55, 99)]
    assert not steps.done(99) and steps.done(100)
    timed = Schedule(1e-3, total=10**6, warmup=10, minutes=1.0, seconds=45.0)  # 45 of 60 s already trained
    assert 0.75 <= timed.progress(20) < 0.9 and timed.lr(20) < 0.5e-3 and not timed.done(20)
    assert Schedule(1e-3, total=10**6, warmup=10, minutes=1.0, seconds=60.0).done(20)
    # the handlers are called as the interpreter would call them: a real signal sent to the test process also
    # reaches whatever native handlers earlier tests' libraries installed
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with StopSignals() as stop:
        assert signal.getsignal(signal.SIGINT) == stop._handle == signal.getsignal(signal.SIGTERM)
        assert not stop.requested
        stop._handle(signal.SIGINT, None)  # Ctrl-C: the run finishes its step, writes a checkpoint, then stops
        assert stop.requested
        with pytest.raises(KeyboardInterrupt):  # a second Ctrl-C interrupts at once
            stop._handle(signal.SIGINT, None)
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_training_uses_bfloat16_only_where_the_device_multiplies_it_natively(monkeypatch):
    """On a CPU without bfloat16 dot products autocast emulates it (a training step ~20x slower) and answering in
    bfloat16 is 4x slower: auto picks float32 there."""
    from verispec.backends.torch_cpu import cpu
    from verispec.cli.train import _gen_dtype
    from verispec.training.checkpoints import bf16_autocast

    for native in (True, False):
        monkeypatch.setattr(cpu, "bfloat16_dot_products", lambda native=native: native)
        assert bf16_autocast(None, torch.device("cpu")) is native
        assert _gen_dtype("auto", "cpu") == ("bfloat16" if native else "float32")
        assert bf16_autocast(None, torch.device("cuda")) is True and _gen_dtype("auto", "cuda") == "bfloat16"
    assert bf16_autocast(True, torch.device("cpu")) is True and bf16_autocast(False, torch.device("cuda")) is False
    assert _gen_dtype("float16", "cpu") == "float16"


def test_the_head_program_is_tried_again_after_cpythons_ast_depth_race_and_only_after_it(tiny_target, monkeypatch,
                                                                                          caplog):
    """CPython 3.11's ast module can raise a spurious SystemError when another thread parses at the same moment
    (python/cpython#106905): the head's program is loaded once more; any other SystemError is a failure, warned, and
    the torch head drafts."""
    from verispec.eagle import engines
    from verispec.eagle.compiled import CompiledHeadSteps

    raised = ["AST constructor recursion depth mismatch (before=189, after=33)"]
    calls = []

    def flaky(cls, head, embedding_model, name="", *, cached_only=False):
        calls.append(cached_only)
        if raised:
            raise SystemError(raised.pop())
        return "the program"

    monkeypatch.setattr(CompiledHeadSteps, "load_or_build", classmethod(flaky))
    head = random_head(tiny_target)
    assert engines.compiled_steps(head, tiny_target, cached_only=True) == "the program" and calls == [True, True]
    head = random_head(tiny_target)
    raised[:] = ["some other fault"]
    calls.clear()
    with caplog.at_level("WARNING"):
        assert engines.compiled_steps(head, tiny_target) is None
    assert calls == [False] and "some other fault" in caplog.text
