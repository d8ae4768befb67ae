"""The engines that run a GGUF file itself (llama.cpp) take its tokenizer alone, converted once and cached, never the
whole model converted to float32: the same ids as transformers' own reading of the file, and a second load converts
nothing."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from verispec.backends import references
from verispec.backends.references import DEFAULT_MODEL, resolve
from zoo import zoo_gguf


def test_a_gguf_files_tokenizer_is_converted_once_and_alone(tmp_path, monkeypatch):
    # the vocabulary llama.cpp's converter knows: the default model's
    vocabulary = AutoTokenizer.from_pretrained(str(resolve(DEFAULT_MODEL)))
    path = zoo_gguf("llama", vocabulary, tmp_path / "tiny")
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    folder = references.ensure_tokenizer(str(path))
    assert folder.parent == tmp_path / "cache" / "tokenizers"
    assert not (tmp_path / "cache" / "gguf").exists()  # the model itself was not converted
    text = "The committee approved the new budget on Monday."
    ours = AutoTokenizer.from_pretrained(str(folder))
    theirs = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert ours(text)["input_ids"] == theirs(text)["input_ids"]
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda *a, **k: pytest.fail("converted again"))
    assert references.ensure_tokenizer(str(path)) == folder
