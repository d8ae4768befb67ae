"""The engine on tiny random models: greedy identity, rollback, determinism, stopping, streaming, errors."""

import pytest
import torch
from transformers import DynamicCache

from tiny import assert_draft_cache_is_a_fresh_pass, loaded, make_model, make_tokenizer
from verispec import IncompatibleDrafter, InvalidRequest, ModelDrafter, NgramDrafter, SpeculativeDecoder

PROMPTS = [[5, 9, 3, 5, 9, 4, 7], [3, 4, 5, 6, 7, 8, 9, 10, 3, 4, 5], [12, 30, 7]]


def plain_greedy(target, prompt, n):
    return SpeculativeDecoder(target).generate(prompt, max_new_tokens=n).token_ids


def hf_greedy(target, prompt, n):
    out = target.model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                                pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_plain_decoding_equals_transformers_generate(tiny_target, prompt):
    assert plain_greedy(tiny_target, prompt, 40) == hf_greedy(tiny_target, prompt, 40)


@pytest.mark.parametrize("k", range(1, 9))
def test_speculative_greedy_equals_plain_greedy_for_every_k(tiny_target, tiny_noisy_draft, tiny_other_draft, k):
    drafters = [
        NgramDrafter(),
        NgramDrafter(),
        ModelDrafter(tiny_noisy_draft, tiny_target),
        ModelDrafter(tiny_other_draft, tiny_target),
        ModelDrafter(tiny_target, tiny_target),  # a perfect draft: everything accepted
    ]
    for prompt in PROMPTS:
        expected = plain_greedy(tiny_target, prompt, 48)
        for drafter in drafters:
            got = SpeculativeDecoder(tiny_target, drafter, k=k, k_policy="fixed").generate(prompt, max_new_tokens=48)
            assert got.token_ids == expected, (drafter, k, prompt)


def test_drafters_actually_draft_and_get_accepted(tiny_target, tiny_noisy_draft):
    perfect = SpeculativeDecoder(tiny_target, ModelDrafter(tiny_target, tiny_target), k=4, k_policy="fixed").generate(
        PROMPTS[0], max_new_tokens=40)
    assert perfect.stats.acceptance_rate == 1.0
    assert perfect.stats.mean_accepted_tokens == pytest.approx(5.0)  # 4 drafts + bonus every step
    noisy = SpeculativeDecoder(tiny_target, ModelDrafter(tiny_noisy_draft, tiny_target), k=4, k_policy="fixed").generate(
        PROMPTS[0], max_new_tokens=40)
    assert 0 < noisy.stats.acceptance_rate < 1
    st = noisy.stats
    assert st.new_tokens == 40 and sum(st.step_tokens) == 40 and len(st.step_tokens) == st.verify_steps
    assert st.accepted == sum(st.accepted_per_position) and st.drafted == sum(st.drafted_per_position)


def test_cache_after_generation_equals_fresh_prefill(tiny_target, tiny_noisy_draft):
    """Rollback leaves exactly the committed tokens in the cache, with the same keys/values as a fresh pass."""
    decoder = SpeculativeDecoder(tiny_target, ModelDrafter(tiny_noisy_draft, tiny_target), k=5, k_policy="fixed")
    g = decoder.generate(PROMPTS[1], max_new_tokens=30)
    assert g.stats.drafted > g.stats.accepted  # rejections happened, so rollbacks happened
    committed = g.prompt_token_ids + g.token_ids
    assert decoder._cached_tokens == committed[:-1]
    fresh = DynamicCache()
    with torch.no_grad():
        tiny_target.model(torch.tensor([committed[:-1]]), cache=fresh, use_cache=True)
    assert len(decoder._cache) == fresh.get_seq_length()
    for mine, ref in zip(decoder._cache.cache.layers, fresh.layers):
        torch.testing.assert_close(mine.keys, ref.keys, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(mine.values, ref.values, atol=1e-5, rtol=1e-4)


def test_draft_model_cache_rolls_back(tiny_target, tiny_noisy_draft):
    drafter = ModelDrafter(tiny_noisy_draft, tiny_target)
    decoder = SpeculativeDecoder(tiny_target, drafter, k=4, k_policy="fixed")
    decoder.generate(PROMPTS[0], max_new_tokens=25)
    assert_draft_cache_is_a_fresh_pass(drafter, tiny_noisy_draft)


def test_prefix_reuse_gives_the_same_output(tiny_target):
    decoder = SpeculativeDecoder(tiny_target, NgramDrafter(), k=4, k_policy="fixed")
    first = decoder.generate(PROMPTS[1], max_new_tokens=20)
    again = decoder.generate(PROMPTS[1] + first.token_ids[:5], max_new_tokens=15)
    assert again.stats.reused_prompt_tokens > len(PROMPTS[1])
    cold = SpeculativeDecoder(tiny_target, NgramDrafter(), k=4, k_policy="fixed", reuse_prefix=False)
    assert again.token_ids == cold.generate(PROMPTS[1] + first.token_ids[:5], max_new_tokens=15).token_ids


def test_the_draft_model_keeps_the_prompt_it_read_for_the_next_request(tiny_target, tiny_noisy_draft, monkeypatch):
    """A second request with the same prompt (an audit's next sample, a conversation's next turn) reads only what
    the draft's cache lacks, and decodes what a fresh drafter decodes."""
    fed = []
    forward = tiny_noisy_draft.forward

    def counting(kv, tokens, **options):
        fed.append(len(tokens))
        return forward(kv, tokens, **options)

    drafter = ModelDrafter(tiny_noisy_draft, tiny_target)
    decoder = SpeculativeDecoder(tiny_target, drafter, k=4, k_policy="fixed")
    monkeypatch.setattr(tiny_noisy_draft, "forward", counting)
    first = decoder.generate(PROMPTS[1], max_new_tokens=12, temperature=1.0, seed=3)
    read_first, fed[:] = sum(fed), []
    again = decoder.generate(PROMPTS[1], max_new_tokens=12, temperature=1.0, seed=3)
    read_again = sum(fed)
    monkeypatch.undo()
    assert again.token_ids == first.token_ids
    assert read_first - read_again >= len(PROMPTS[1]) - 2  # the prompt was not read a second time
    assert_draft_cache_is_a_fresh_pass(drafter, tiny_noisy_draft)
    fresh = SpeculativeDecoder(tiny_target, ModelDrafter(tiny_noisy_draft, tiny_target), k=4, k_policy="fixed")
    assert fresh.generate(PROMPTS[1], max_new_tokens=12, temperature=1.0, seed=3).token_ids == first.token_ids


@pytest.mark.parametrize("drafter_kind", ["none", "ngram", "model"])
def test_same_seed_same_sample_different_seed_different(tiny_target, tiny_noisy_draft, drafter_kind):
    drafter = {"none": None, "ngram": NgramDrafter(),
               "model": ModelDrafter(tiny_noisy_draft, tiny_target)}[drafter_kind]
    decoder = SpeculativeDecoder(tiny_target, drafter, k=3, k_policy="fixed")
    runs = [decoder.generate(PROMPTS[0], max_new_tokens=30, temperature=1.0, seed=s).token_ids for s in (1, 1, 2)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]
    unseeded = decoder.generate(PROMPTS[0], max_new_tokens=30, temperature=1.0)
    replay = decoder.generate(PROMPTS[0], max_new_tokens=30, temperature=1.0, seed=unseeded.seed)
    assert unseeded.token_ids == replay.token_ids  # the seed an unseeded run used is reported and replays it


def test_eos_stops_and_is_included(tiny_target):
    expected = plain_greedy(tiny_target, PROMPTS[0], 30)
    eos = expected[10]
    target = loaded(tiny_target.model, tiny_target.tokenizer, eos=frozenset({eos}))
    for drafter in (None, NgramDrafter(), ModelDrafter(target, target)):
        g = SpeculativeDecoder(target, drafter, k=6, k_policy="fixed").generate(PROMPTS[0], max_new_tokens=30)
        assert g.token_ids == expected[: expected.index(eos) + 1]
        assert g.finish_reason == "stop"


def test_max_new_tokens_is_exact_and_reports_length(tiny_target):
    for n in (1, 2, 7):
        g = SpeculativeDecoder(tiny_target, ModelDrafter(tiny_target, tiny_target), k=8, k_policy="fixed").generate(
            PROMPTS[0], max_new_tokens=n)
        assert len(g.token_ids) == n and g.finish_reason == "length"


def test_stop_string_cuts_text_and_tokens(tiny_target):
    full = SpeculativeDecoder(tiny_target).generate(PROMPTS[0], max_new_tokens=20)
    words = full.text.split()
    stop = " ".join(words[4:6])
    g = SpeculativeDecoder(tiny_target, NgramDrafter(), k=4, k_policy="fixed").generate(
        PROMPTS[0], max_new_tokens=20, stop=[stop])
    assert g.finish_reason == "stop"
    assert stop not in g.text and full.text.startswith(g.text)
    assert g.text.rstrip() == " ".join(words[:4])
    # token ids end with the token that completed the text before the stop string
    assert g.token_ids == full.token_ids[: len(g.token_ids)] and len(g.token_ids) < len(full.token_ids)
    assert tiny_target.tokenizer.decode(g.token_ids, skip_special_tokens=True).startswith(g.text.rstrip())


def test_stream_deltas_add_up_to_the_text(tiny_target, tiny_noisy_draft):
    decoder = SpeculativeDecoder(tiny_target, ModelDrafter(tiny_noisy_draft, tiny_target), k=3, k_policy="fixed")
    stream = decoder.stream(PROMPTS[2], max_new_tokens=25)
    deltas = list(stream)
    assert len(deltas) > 1
    assert "".join(deltas) == stream.result.text == tiny_target.tokenizer.decode(stream.result.token_ids)


def test_closing_a_stream_stops_generation(tiny_target):
    decoder = SpeculativeDecoder(tiny_target)
    stream = decoder.stream(PROMPTS[0], max_new_tokens=200)
    it = iter(stream)
    next(it)
    stream.close()
    with pytest.raises(StopIteration):
        next(it)
    # the decoder is usable afterwards, and its kept cache is consistent
    assert decoder.generate(PROMPTS[0], max_new_tokens=5).token_ids == plain_greedy(tiny_target, PROMPTS[0], 5)


def test_chat_and_raw_prompts_encode(tiny_target):
    decoder = SpeculativeDecoder(tiny_target)
    assert decoder.encode("w5 w6 w7", raw=True) == [5, 6, 7]
    g = decoder.generate("w5 w6 w7", raw=True, max_new_tokens=3)
    assert g.prompt_token_ids == [5, 6, 7] and len(g.token_ids) == 3


@pytest.mark.parametrize(
    "prompt, kwargs, words",
    [
        ("", {}, "prompt is empty"),
        ("   ", {}, "prompt is empty"),
        ([], {}, "prompt must be"),
        ([5, 999], {}, "outside the vocabulary"),
        ([5, 6], dict(k=0), "k \\(draft tokens per step\\) must be a whole number >= 1"),
        ([5, 6], dict(temperature=-1), "temperature must be >= 0"),
        ([5, 6], dict(top_p=0), "top_p must be in"),
        ([5, 6], dict(top_p=1.01), "top_p must be in"),
        ([5, 6], dict(max_new_tokens=0), "max_new_tokens must be"),
        ([5, 6], dict(seed="x"), "seed must be an integer"),
        ([5, 6], dict(stop=[3]), "stop must be"),
        (list(range(3, 32)) * 9, {}, "context window is 256"),
    ],
)
def test_bad_input_gets_a_clear_error(tiny_target, prompt, kwargs, words):
    with pytest.raises(InvalidRequest, match=words):
        SpeculativeDecoder(tiny_target, NgramDrafter()).generate(prompt, **kwargs)


def test_bad_decoder_configuration(tiny_target):
    with pytest.raises(InvalidRequest, match="k \\(draft tokens per step\\)"):
        SpeculativeDecoder(tiny_target, NgramDrafter(), k=0, k_policy="fixed")
    with pytest.raises(InvalidRequest, match="acceptance must be one of strict, typical"):
        SpeculativeDecoder(tiny_target, acceptance="fast")


def test_mismatched_draft_vocabulary_is_refused(tiny_target):
    other = loaded(make_model(seed=3), make_tokenizer(rename={7: "seven"}))
    with pytest.raises(IncompatibleDrafter, match="differ at id 7"):
        ModelDrafter(other, tiny_target)


def test_a_draft_with_another_chat_template_pairs_and_decodes_as_plain(tiny_target, caplog):
    """The draft reads the target's token ids, never its own template: a different template is a note, not a
    refusal (Qwen2.5-Coder 0.5B and 1.5B ship different ones); different special tokens still refuse."""
    import logging

    target_tok = make_tokenizer()
    target_tok.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    target = loaded(tiny_target.model, target_tok)
    draft_tok = make_tokenizer()
    draft_tok.chat_template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}"
    draft = loaded(make_model(seed=5), draft_tok)
    with caplog.at_level(logging.INFO, logger="verispec.compat"):
        drafter = ModelDrafter(draft, target)
    assert "different chat templates" in caplog.text
    expected = plain_greedy(target, PROMPTS[0], 30)
    assert SpeculativeDecoder(target, drafter, k=3, k_policy="fixed").generate(PROMPTS[0], max_new_tokens=30).token_ids == expected
    other_eos = make_tokenizer()
    other_eos.eos_token = other_eos.convert_ids_to_tokens(5)
    with pytest.raises(IncompatibleDrafter, match="eos_token_id"):
        ModelDrafter(loaded(make_model(seed=5), other_eos), target)


def test_padded_draft_vocabulary_is_accepted(tiny_target):
    """A draft with a wider embedding (padded vocabulary) and the same token map pairs fine."""
    wide = loaded(make_model(seed=4, vocab=40), make_tokenizer(vocab=32))
    drafter = ModelDrafter(wide, tiny_target)
    expected = plain_greedy(tiny_target, PROMPTS[0], 30)
    assert SpeculativeDecoder(tiny_target, drafter, k=3, k_policy="fixed").generate(PROMPTS[0], max_new_tokens=30).token_ids == expected
    g = SpeculativeDecoder(tiny_target, drafter, k=3, k_policy="fixed").generate(PROMPTS[0], max_new_tokens=30, temperature=1, seed=0)
    assert all(t < 32 for t in g.token_ids)


def test_lossy_mode_is_reported(tiny_target):
    g = SpeculativeDecoder(tiny_target, NgramDrafter(), acceptance="typical").generate(PROMPTS[0], max_new_tokens=5)
    assert g.stats.lossy and g.stats.acceptance == "typical"
    assert "LOSSY" in g.stats.summary()
    strict = SpeculativeDecoder(tiny_target, NgramDrafter()).generate(PROMPTS[0], max_new_tokens=5)
    assert not strict.stats.lossy


def test_a_pass_called_outside_the_engine_builds_no_autograd_graph(tiny_target):
    kv = tiny_target.new_kv()
    out = tiny_target.forward(kv, [3, 4, 5], feature_layers=(1,))
    assert not out.logits.requires_grad and not out.hidden.requires_grad


def test_the_engine_refuses_what_is_not_a_target_or_a_drafter(tiny_target):
    class Lookalike:  # a protocol's shape without its base class
        name, feature_layers, tree_depth = "lookalike", (), None

    with pytest.raises(InvalidRequest, match="derive from verispec.drafters.DrafterBase"):
        SpeculativeDecoder(tiny_target, Lookalike())
    with pytest.raises(InvalidRequest, match="TargetModelBase"):
        SpeculativeDecoder(Lookalike())
