"""Incremental detokenisation: the text built token by token equals decoding all tokens at once, for the real
default tokenizer (byte-level BPE, multi-byte characters split across tokens) and the tiny word-level one."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiny import make_tokenizer
from verispec.text import TextAssembler

TEXTS = ["Hello, world! naïve café — 東京 🙂 done.", "  spaces\tand\nlines  ", "x = [1, 2, 3]  # 🐍🐍", "ééé"]


@pytest.fixture(scope="module")
def smol_tokenizer():
    from transformers import AutoTokenizer

    from verispec.backends.references import BUILTINS, ensure_builtin

    return AutoTokenizer.from_pretrained(str(ensure_builtin(BUILTINS["smollm2-135m"])))


def assemble(tokenizer, ids, chunks):
    t = TextAssembler(tokenizer)
    out, i = "", 0
    for n in chunks:
        out += t.add(ids[i : i + n])
        i += n
    out += t.add(ids[i:]) if i < len(ids) else ""
    return out + t.finish(), t


@pytest.mark.e2e
def test_incremental_text_equals_full_decode_on_the_default_tokenizer(smol_tokenizer):
    for text in TEXTS:
        ids = smol_tokenizer(text, add_special_tokens=False)["input_ids"]
        for chunks in ([1] * len(ids), [2, 3, 1] * len(ids), [len(ids)]):
            out, t = assemble(smol_tokenizer, ids, chunks)
            assert out == t.emitted == smol_tokenizer.decode(ids, skip_special_tokens=True), (text, chunks)


@pytest.mark.e2e
@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 49151), min_size=1, max_size=40), st.lists(st.integers(1, 4), min_size=1))
def test_incremental_text_on_random_ids(smol_tokenizer, ids, chunks):
    """Random ids (incomplete UTF-8 and special tokens included): deltas never retract, and what is released
    is a prefix of the full decode that ends equal to it (trailing replacement characters aside)."""
    full = smol_tokenizer.decode(ids, skip_special_tokens=True)
    out, _ = assemble(smol_tokenizer, ids, chunks * len(ids))
    assert full.startswith(out) and out.rstrip("\ufffd") == full.rstrip("\ufffd")


def test_incremental_text_on_the_word_level_tokenizer():
    tok = make_tokenizer()
    ids = [5, 9, 13, 2, 7, 3, 3, 40]
    out, t = assemble(tok, ids, [1, 2, 1, 3, 1])
    assert out == tok.decode(ids, skip_special_tokens=True)
    assert t._read > 0  # the window moved: later steps did not decode from the start
