"""The blocks backend builds a model straight from a GGUF file (``verispec.backends.gguf_model``): nothing converted
to float32 on disk, the token embedding kept as the file's blocks, and the same model, bit for bit, as finding each
matrix's rows by value in the file's float32 conversion. Tiny zoo families as Q8_0 files from llama.cpp's own
converter: Llama (q / k rows permuted), Qwen2 (attention biases, tied embeddings), Gemma 3 (norms stored as w + 1,
scaled embeddings, sliding layers), Phi-3 (fused projections)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from conftest import require_llama_cpp
from verispec import blockmm
from verispec.backends import blocks, gguf_model
from verispec.backends.block_modules import BlockEmbedding
from verispec.backends.gguf_header import read_header
from verispec.backends.hf import load as load_transformers
from verispec.backends.openvino.gguf_blocks import GGUFRows
from verispec.backends.references import DEFAULT_MODEL, cache_dir, resolve
from zoo import zoo_gguf

pytestmark = pytest.mark.skipif(not blockmm.available(), reason=str(blockmm.why_unavailable()))

TOKENS = [1, 5, 9, 7, 3, 5, 9, 7, 3, 11, 4, 6, 8, 10]


@pytest.fixture(scope="module")
def tokenizer():
    require_llama_cpp()  # the converter comes with llama-cpp-python's source
    return AutoTokenizer.from_pretrained(str(resolve(DEFAULT_MODEL)))


@pytest.fixture(scope="module")
def files(tokenizer, tmp_path_factory):
    """family -> its tiny model as a Q8_0 GGUF, written once for the module."""
    made = {}

    def file(family: str):
        if family not in made:
            made[family] = zoo_gguf(family, tokenizer, tmp_path_factory.mktemp("zoo") / family, outtype="q8_0")
        return made[family]
    return file


@pytest.fixture
def same_tokenizer(tokenizer, monkeypatch):
    """Every file carries ``tokenizer``: hand it over instead of converting each file's copy (seconds apiece)."""
    original = AutoTokenizer.from_pretrained
    monkeypatch.setattr(AutoTokenizer, "from_pretrained",
                        lambda *a, **k: tokenizer if k.get("gguf_file") else original(*a, **k))
    return tokenizer


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3", "phi3"])
def test_built_from_the_file_is_the_model_found_by_value(family, files, same_tokenizer):
    path = files(family)
    conversions = set((cache_dir() / "gguf").glob(f"{path.stem}-*"))
    direct = blocks.load(str(path))
    assert set((cache_dir() / "gguf").glob(f"{path.stem}-*")) == conversions  # nothing written in float32
    by_value = blocks.on_blocks(load_transformers(str(path), pack=False), GGUFRows.read(path))
    assert direct.swapped == by_value.swapped and direct.swapped.left == [] and "Q8_0" in direct.swapped.kinds
    assert direct.width_invariant == by_value.width_invariant
    assert direct.eos_token_ids == by_value.eos_token_ids and direct.vocab_size == by_value.vocab_size
    assert not [n for n, p in direct.model.named_parameters() if p.is_meta]
    table = direct.model.get_input_embeddings()  # the file's blocks, dequantized on reading
    assert isinstance(table, BlockEmbedding) and table.kind.name == "Q8_0"
    assert torch.equal(table.weight, by_value.model.get_input_embeddings().weight)
    want = by_value.forward(by_value.new_kv(), TOKENS).logits
    assert torch.equal(direct.forward(direct.new_kv(), TOKENS).logits, want)


def test_the_embedding_keeps_the_rows_it_dequantized_and_gives_the_tables_values(files, same_tokenizer):
    table = blocks.load(str(files("llama"))).model.get_input_embeddings()
    full = table.weight  # the whole table, dequantized on reading
    table._most = 4  # room for a few rows: the oldest go as new ones come
    for ids in ([[3]], [[3, 9, 3, 1]], [[5, 6, 7, 8, 2]], [[9]], [[3], [7]]):
        ids = torch.tensor(ids)
        assert torch.equal(table(ids), full[ids])
        assert len(table._rows) <= max(4, ids.unique().numel())


def test_step_costs_are_keyed_by_the_file_and_the_kernels_threads(files, same_tokenizer):
    """A model built straight from its GGUF stores its step costs (the file is its key's source: it had none) under the
    kernel's threads, not torch's (one during its passes)."""
    model = blocks.load(str(files("llama")))
    key = model.measurement_key
    assert key is not None and key["backend"] == "blocks" and key["threads"] == blockmm.default_threads()
    before, saved = blockmm.default_threads(), blockmm._threads
    try:
        blockmm.set_threads(before + 1)
        assert model.measurement_key["threads"] == before + 1 and model.measurement_key["model"] == key["model"]
    finally:
        blockmm.set_threads(saved)


def test_the_configuration_is_read_once_and_kept(files, same_tokenizer, monkeypatch):
    from transformers import modeling_gguf_pytorch_utils

    path = files("qwen2")
    first = blocks.load(str(path))
    monkeypatch.setattr(modeling_gguf_pytorch_utils, "load_gguf_checkpoint",
                        lambda *a, **k: pytest.fail("the metadata was read again"))
    again = blocks.load(str(path))
    assert torch.equal(again.forward(again.new_kv(), TOKENS).logits, first.forward(first.new_kv(), TOKENS).logits)


def test_a_matrix_the_loader_rewrites_falls_back_to_rows_found_by_value(files, same_tokenizer, monkeypatch, caplog):
    path = files("llama")
    want = blocks.load(str(path))

    class Scaling:  # a processor that changes a matrix's values, not only its row order
        def process(self, weights, name, **kwargs):
            return type("Done", (), {"weights": weights * 2, "name": name})()

    with pytest.raises(gguf_model.NotRowOrder, match="beyond its row order"):
        gguf_model._row_order(Scaling(), "blk.0.attn_q.weight", 4, {}, {})
    monkeypatch.setattr(gguf_model, "_row_order", lambda *a: (_ for _ in ()).throw(gguf_model.NotRowOrder("test")))
    with caplog.at_level(logging.WARNING):
        got = blocks.load(str(path))
    assert "from its float32 conversion instead" in caplog.text
    assert torch.equal(got.forward(got.new_kv(), TOKENS).logits, want.forward(want.new_kv(), TOKENS).logits)


def test_the_header_walk_is_ggufs_own_reading(files):
    from gguf import GGUFReader

    path = files("gemma3")
    header = read_header(path)
    theirs = GGUFReader(str(path))
    assert header.architecture == "gemma3"
    assert [t.name for t in header.tensors] == [t.name for t in theirs.tensors]
    for mine, tensor in zip(header.tensors, theirs.tensors):
        assert mine.kind == tensor.tensor_type.name and mine.nbytes == int(tensor.n_bytes)
        assert mine.shape == tuple(int(d) for d in reversed(tensor.shape))
        assert np.array_equal(mine.data.reshape(-1), np.asarray(tensor.data).view(np.uint8).reshape(-1))


def test_converting_the_tokenizer_keeps_the_configuration_it_read(files, monkeypatch):
    """The configuration is read from the metadata once, with the tokenizer (the Qwens' vocabulary makes each reading
    about 10 s), and the load then reads it from beside the tokenizer."""
    import json

    from transformers import modeling_gguf_pytorch_utils

    from verispec.backends.references import GGUF_CONFIG_FILE, ensure_tokenizer

    path = files("llama")
    monkeypatch.setenv("VERISPEC_CACHE", str(path.parent / "cache"))  # no tokenizer converted yet
    folder = ensure_tokenizer(str(path))
    want = modeling_gguf_pytorch_utils.load_gguf_checkpoint(str(path), return_tensors=False)["config"]
    assert json.loads((folder / GGUF_CONFIG_FILE).read_text()) == json.loads(json.dumps(want))
    monkeypatch.setattr(modeling_gguf_pytorch_utils, "load_gguf_checkpoint",
                        lambda *a, **k: pytest.fail("the metadata was read again"))
    assert blocks.load(str(path)).model.config.num_hidden_layers == want["num_hidden_layers"]


def _without_origin(config) -> dict:
    """A configuration's values but where it was read from and the loader's quantization note."""
    return {k: v for k, v in config.to_dict().items() if k not in ("_name_or_path", "quantization_config")}


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3", "phi3"])
def test_the_float32_conversion_is_transformers_loaders_model(family, files, same_tokenizer):
    """The transformers backend's conversion of a GGUF file (``gguf_model.dequantized``, the metadata read once) is
    the model transformers' own ``from_pretrained(gguf_file=...)`` builds: every tensor the same bits, the same
    configuration."""
    from transformers import AutoModelForCausalLM

    path = files(family)
    ours = gguf_model.dequantized(path)
    theirs = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    mine, want = ours.state_dict(), theirs.state_dict()
    assert mine.keys() == want.keys()
    assert [k for k in want if not torch.equal(mine[k], want[k])] == []
    assert _without_origin(ours.config) == _without_origin(theirs.config)
    assert ours.generation_config.to_dict() == theirs.generation_config.to_dict()


@pytest.mark.parametrize("failure", [gguf_model.NotRowOrder("test"), KeyError("an unknown architecture's key")])
def test_converting_a_file_transformers_must_convert_still_converts(failure, files, same_tokenizer, monkeypatch,
                                                                     caplog, tmp_path):
    """Where the file's tensors do not fill the model by transformers' loop alone (``NotRowOrder``), or reading it
    directly fails otherwise, the conversion is transformers' ``from_pretrained``: the same folder either way."""
    from safetensors.torch import load_file

    from verispec.backends import references

    path = files("qwen2")
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "fast"))
    fast = references.ensure_converted_gguf(path)
    assert (fast / references.GGUF_CONFIG_FILE).is_file()  # the blocks backend builds from it without reading again

    def refuse(*args, **kwargs):
        raise failure

    monkeypatch.setattr(gguf_model, "dequantized", refuse)
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "slow"))
    with caplog.at_level(logging.INFO, logger="verispec.backends.references"):
        slow = references.ensure_converted_gguf(path)
    assert "converting with transformers' from_pretrained" in caplog.text
    assert isinstance(failure, gguf_model.NotRowOrder) or "reading it directly failed (KeyError" in caplog.text
    a, b = load_file(fast / "model.safetensors"), load_file(slow / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (fast / "config.json").read_text() == (slow / "config.json").read_text()


def test_sliding_window_layers_attend_row_by_row_past_the_window(files, same_tokenizer, monkeypatch):
    """Gemma 3's sliding-window layers (every other layer; 6 tokens in the zoo) on blocks attend row by row over their
    window as its full layers do over all keys: a 30-token pass's logits are SDPA's under transformers' masks (the
    same products, so up to rounding), and past the window greedy speculation and token trees (n-gram branches) give
    plain decoding's tokens (before, those layers ran SDPA and a real Gemma 3's greedy speculation left plain
    decoding)."""
    from verispec import SpeculativeDecoder, make_drafter

    model = blocks.load(str(files("gemma3")))
    assert model.width_invariant and model.model.config.sliding_window == 6
    ids = [int(t) for t in torch.randint(3, 200, (30,), generator=torch.Generator().manual_seed(5))]
    with torch.no_grad():
        rows = model.model(torch.tensor([ids])).logits[0]
        model.model.set_attn_implementation("sdpa")
        try:
            sdpa = model.model(torch.tensor([ids])).logits[0]
        finally:
            model.model.set_attn_implementation("verispec_rows")
    assert (rows - sdpa).abs().max() < 1e-2 * sdpa.abs().max(), (rows - sdpa).abs().max()
    from verispec.backends.hf import row_attention

    with monkeypatch.context() as patched, torch.no_grad():  # the window ignored: far from SDPA's, so the check bites
        patched.setattr(row_attention, "_plain_window",
                        lambda mask, length, rows, window: (row_attention._causal_counts(length, rows), None))
        unwindowed = model.model(torch.tensor([ids])).logits[0]
    assert (unwindowed - sdpa).abs().max() > 5e-2 * sdpa.abs().max()
    plain = SpeculativeDecoder(model)
    want = plain.generate(ids[:10], max_new_tokens=24).token_ids
    for name, options in (("ngram", {}), ("ngram", {"branches": 3}), ("suffix", {})):
        got = SpeculativeDecoder(model, make_drafter(name, target=model, **options), k=4,
                                 k_policy="fixed").generate(ids[:10], max_new_tokens=24)
        assert got.token_ids == want, (name, options)
