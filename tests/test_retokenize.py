"""A draft model with another tokenizer (``--drafter model``, drafts through text).

The sharpest check is a draft that is the target itself under another tokenizer (the same network with its token
ids permuted, and a tokenizer that spells each id's word): its greedy text is the target's, so a drafter that
translates correctly has every draft token accepted, and one that gets any token boundary or id wrong does not.
Text round trips are checked on byte-level BPE and SentencePiece-style (Metaspace) tokenizers, as SmolLM2 and
Gemma use; the exact distribution on the tiny vocabulary shows the one-hot drafts keep sampling lossless.
"""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings, strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from statistical_helpers import ALPHA, joint_p_value
from tiny import VOCAB, loaded, make_model, make_tokenizer
from verispec import SamplingParams, SpeculativeDecoder, make_drafter
from verispec.drafters.model import ModelDrafter
from verispec.drafters.retokenize import RetokenizingDrafter, decode_after, encode_after
from verispec.errors import IncompatibleDrafter

# a permutation of the word ids (0-2 are <unk>, <s>, </s> and stay)
SIGMA = [0, 1, 2] + [3 + (7 * i) % (VOCAB - 3) for i in range(VOCAB - 3)]


def permuted(target):
    """The target's network with token ids permuted: draft id j is target id SIGMA[j], with a tokenizer that
    spells draft id j as target id SIGMA[j]'s word."""
    words = make_tokenizer(VOCAB).convert_ids_to_tokens(SIGMA)
    tokenizer = make_tokenizer(VOCAB, rename=dict(enumerate(words)))
    model = LlamaForCausalLM(target.model.config).eval()
    state = dict(target.model.state_dict())
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        state[name] = state[name][SIGMA].clone()
    model.load_state_dict(state)
    return loaded(model, tokenizer, name="tiny-permuted")


@pytest.fixture(scope="module")
def permuted_draft(tiny_target):
    return permuted(tiny_target)


def test_the_model_drafter_drafts_through_text_when_the_tokenizers_differ(tiny_target, permuted_draft,
                                                                          tiny_noisy_draft):
    assert isinstance(make_drafter("model", target=tiny_target, draft_model=permuted_draft), RetokenizingDrafter)
    assert isinstance(make_drafter("model", target=tiny_target, draft_model=tiny_noisy_draft), ModelDrafter)
    forced = make_drafter("model", target=tiny_target, draft_model=tiny_noisy_draft, retokenize="on")
    assert isinstance(forced, RetokenizingDrafter)
    with pytest.raises(IncompatibleDrafter, match="differ at id 4.*retokenize off.*auto"):
        make_drafter("model", target=tiny_target, draft_model=permuted_draft, retokenize="off")


@pytest.mark.parametrize("new", [30, 200])  # 200: the answer is translated in settled chunks, then the tail
def test_a_draft_that_is_the_target_under_another_tokenizer_has_every_draft_accepted(tiny_target, permuted_draft,
                                                                                     new):
    prompt = [5, 9, 3, 5, 9, 12]
    plain = SpeculativeDecoder(tiny_target).generate(prompt, max_new_tokens=new)
    drafter = make_drafter("model", target=tiny_target, draft_model=permuted_draft)
    got = SpeculativeDecoder(tiny_target, drafter, k=4, k_policy="fixed").generate(prompt, max_new_tokens=new)
    assert got.token_ids == plain.token_ids
    assert got.stats.drafted >= 2 * new // 3 and got.stats.accepted == got.stats.drafted
    # k + 1 draft steps give k + 1 words; the last is dropped (text may end inside a word), so k are proposed
    assert max(got.stats.step_drafted) == 4 and drafter.draft_steps <= 5 * got.stats.drafts
    assert drafter.proposed == got.stats.drafted


def test_greedy_output_is_plain_decoding_with_a_draft_that_disagrees(tiny_target, tiny_other_draft):
    prompt = [5, 9, 3, 5, 9]
    plain = SpeculativeDecoder(tiny_target).generate(prompt, max_new_tokens=30)
    for k in (1, 3, 6):
        drafter = make_drafter("model", target=tiny_target, draft_model=tiny_other_draft, retokenize="on")
        got = SpeculativeDecoder(tiny_target, drafter, k=k, k_policy="fixed").generate(prompt, max_new_tokens=30)
        assert got.token_ids == plain.token_ids, k
        assert got.stats.drafted > 0


def test_sampled_output_follows_the_exact_joint_distribution(tiny_target, permuted_draft):
    """Greedy drafts are one-hot proposals: at temperature 1 each is accepted with probability p(x) (one-hot drafts
    under top-k / top-p are the n-gram drafter's case in test_statistical)."""
    drafter = make_drafter("model", target=tiny_target, draft_model=permuted_draft)
    decoder = SpeculativeDecoder(tiny_target, drafter, k=3, k_policy="fixed")
    assert joint_p_value(decoder, SamplingParams(temperature=1.0)) > ALPHA
    assert drafter.proposed > 1000  # drafts were made and verified


class Ending:
    """A draft model whose greedy choice is its end-of-sequence token after ``after`` drafted tokens."""

    def __init__(self, inner, after: int):
        self.inner, self.after, self.tokenizer, self.fed = inner, after, inner.tokenizer, 0
        self.eos_token_ids = frozenset({inner.tokenizer.eos_token_id})

    def new_kv(self):
        return self.inner.new_kv()

    def forward(self, kv, tokens, **options):
        out = self.inner.forward(kv, tokens, **options)
        self.fed += 1
        if self.fed > self.after:
            out.logits[..., self.inner.tokenizer.eos_token_id] = 1e4
        return out


def test_the_drafts_end_where_the_draft_model_ends(tiny_target, permuted_draft):
    """A draft model that emits its end-of-sequence token proposes the target's there (and nothing after it)."""
    expected = SpeculativeDecoder(tiny_target).generate([5, 9, 3, 5, 9], max_new_tokens=3).token_ids
    drafter = RetokenizingDrafter(Ending(permuted_draft, after=3), tiny_target)
    # three words from three steps (none dropped: the draft ended), then the target's </s>
    assert drafter.propose([5, 9, 3, 5, 9], 6).tokens == expected + [tiny_target.tokenizer.eos_token_id]


# ----------------------------------------------------------------------------------------- text round trips

CORPUS = ["The quick brown fox jumps over the lazy dog.", "Hello, world! Héllo wörld, naïve café.",
          "def main():\n    return 42  # the answer", "Paris, Lyon and Marseille are cities in France.",
          "1 + 2 = 3; 10 * 10 = 100.", "東京は日本の首都です。"] * 4


def trained(kind: str) -> PreTrainedTokenizerFast:
    """A small BPE tokenizer of the kind SmolLM2 (byte-level, 'Ġ') or Gemma (Metaspace, '▁') use."""
    tok = Tokenizer(models.BPE(unk_token=None if kind == "bytelevel" else "<unk>", byte_fallback=kind != "bytelevel"))
    if kind == "bytelevel":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace(prepend_scheme="first")])
        alphabet = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=alphabet,
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


TOKENIZERS = {kind: trained(kind) for kind in ("bytelevel", "metaspace")}
TEXT = st.text(st.sampled_from(list("abcdefghij ,.\néü東")), min_size=1, max_size=40)


@pytest.mark.parametrize("kind", TOKENIZERS)
@settings(max_examples=60, deadline=None)
@given(text=TEXT, cut=st.integers(0, 40))
def test_decode_after_gives_the_text_the_tail_adds(kind, text, cut):
    tokenizer = TOKENIZERS[kind]
    ids = tokenizer.encode(text, add_special_tokens=False)
    start = min(cut, len(ids))
    whole = tokenizer.decode(ids, skip_special_tokens=True)
    head = tokenizer.decode(ids[:start], skip_special_tokens=True)
    assume(not head.endswith("\ufffd"))  # a cut inside a character's bytes has no text of its own
    assert head + decode_after(tokenizer, ids, start) == whole


@pytest.mark.parametrize("kind", TOKENIZERS)
@settings(max_examples=60, deadline=None)
@given(anchor=TEXT, text=TEXT)
def test_encode_after_continues_the_anchor_text(kind, anchor, text):
    tokenizer = TOKENIZERS[kind]
    base = tokenizer.encode(anchor, add_special_tokens=False)
    after = encode_after(tokenizer, anchor, text)
    if kind == "bytelevel":
        assert after  # byte-level text always has a continuation that spells it
    if after:
        assert tokenizer.decode(base + after, skip_special_tokens=True) == tokenizer.decode(
            tokenizer.encode(anchor + text, add_special_tokens=False), skip_special_tokens=True)


def test_the_transformers_peer_runs_universal_assisted_generation_with_another_tokenizer(tiny_target):
    """``hf:assisted:REF`` hands transformers both tokenizers when the vocabularies differ in size (how transformers
    tells them apart: its cross-tokenizer mode), so bench can race the two implementations."""
    from verispec.bench import build_method

    wider = loaded(make_model(seed=7, vocab=40), make_tokenizer(40), name="wider")
    method = build_method("hf:assisted:wider", tiny_target, lambda ref, **_: wider)
    ids = [5, 9, 3, 5, 9, 12]
    assert method.run(ids, 12).token_ids == SpeculativeDecoder(tiny_target).generate(ids, max_new_tokens=12).token_ids
