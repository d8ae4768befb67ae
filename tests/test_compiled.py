"""The opt-in compiled one-token step (verispec.backends.hf.compiled) and the fixed-buffer cache it runs on.

The cache is checked eagerly (no compiler) against a fresh forward over the whole sequence, through rollbacks,
trees and growth; the compiled step is compiled once on a tiny model and must give greedy output identical to the
eager path, plain and speculative; a compiler failure must leave decoding eager and working."""

import logging

import pytest
import torch
from tiny import loaded, make_model

from verispec.backends.hf import compiled as compiled_module
from verispec.backends.hf.cache import TorchKV
from verispec.backends.hf.compiled import FixedKV, unpacked_copy
from verispec.drafters.ngram import NgramDrafter
from verispec.engine import SpeculativeDecoder
from verispec.errors import InvalidRequest
from verispec.backends.hf.packing import PackedLinear, pack_linear_layers


def _fresh(model, tokens):
    with torch.inference_mode():
        return model(input_ids=torch.tensor([tokens])).logits[0]


@pytest.fixture
def small_growth(monkeypatch):
    monkeypatch.setattr(compiled_module, "GROWTH", 8)  # grow every 8 positions: many resizes in a short test


def test_fixed_cache_passes_match_a_fresh_forward_through_rollback_and_growth(small_growth):
    target = loaded(make_model(seed=3))
    kv = FixedKV(capacity=8)
    seq = [5, 9, 3, 5, 9, 4]
    with torch.inference_mode():
        target.forward(kv, seq, last_only=True)
        assert len(kv) == 6 and kv.capacity == 8
        for step in ([7], [11, 12, 13, 14, 15], [6]):  # one token, a wide pass that grows the buffers, one
            out = target.forward(kv, step).logits
            seq += step
            torch.testing.assert_close(out, _fresh(target.model, seq)[-len(step):], atol=1e-5, rtol=1e-5)
        assert kv.capacity == 16 and len(kv) == 13
        kv.truncate(9)  # rollback: columns 9..12 are stale and must not be read
        seq = seq[:9] + [20, 21]
        out = target.forward(kv, [20, 21]).logits
        torch.testing.assert_close(out, _fresh(target.model, seq)[-2:], atol=1e-5, rtol=1e-5)
        assert len(kv) == 11 and all(int(layer.cumulative_length) == 11 for layer in kv.cache.layers)


def test_a_tree_pass_on_the_fixed_cache_matches_each_branch_alone():
    target = loaded(make_model(seed=4))
    kv = FixedKV()
    prompt = [5, 9, 3, 5]
    parents = [-1, 0, -1]  # nodes: 10 (root), 11 under it, 12 a second root
    with torch.inference_mode():
        target.forward(kv, prompt[:-1], last_only=True)
        out = target.forward(kv, [prompt[-1], 10, 11, 12], parents=parents).logits
    torch.testing.assert_close(out[2], _fresh(target.model, prompt + [10, 11])[-1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[3], _fresh(target.model, prompt + [12])[-1], atol=1e-5, rtol=1e-5)


def test_unpacked_copy_shares_the_weights_and_drops_the_packing():
    model = make_model(seed=1)
    packed = pack_linear_layers(model)  # 0 where this torch build cannot pack: the copy is then a plain copy
    assert sum(isinstance(m, PackedLinear) for m in model.modules()) == packed
    copy = unpacked_copy(model)
    assert not any(isinstance(m, PackedLinear) for m in copy.modules())
    assert all(a is b for a, b in zip(model.parameters(), copy.parameters()))
    ids = torch.tensor([[5, 9, 3]])
    with torch.inference_mode():
        torch.testing.assert_close(copy(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-5, rtol=1e-5)


def _greedy(target, drafter, prompt, n=40):
    return SpeculativeDecoder(target, drafter, k=4, reuse_prefix=False).generate(prompt, max_new_tokens=n).token_ids


def test_compiled_step_gives_the_eager_greedy_output_plain_and_speculative(small_growth):
    from torch._dynamo.utils import counters

    model = make_model(seed=5, scale=0.5)
    pack_linear_layers(model)
    eager = loaded(model)
    fast = loaded(model)
    graphs = counters["stats"]["unique_graphs"]
    assert fast.compile_step() is True
    assert fast.step.compile_seconds > 0 and "compiled" in fast.kernel
    assert isinstance(fast.new_kv(), FixedKV) and isinstance(eager.new_kv(), TorchKV)
    prompt = [5, 9, 3, 5, 9, 4]
    expected = _greedy(eager, None, prompt)
    assert _greedy(fast, None, prompt) == expected  # every step compiled, the buffers grown 5 times
    assert _greedy(fast, NgramDrafter(), prompt) == expected  # compiled steps and eager verify passes mixed
    kv = fast.new_kv()
    with torch.inference_mode():
        fast.forward(kv, prompt[:-1], last_only=True)
        out = fast.forward(kv, prompt[-1:]).logits
    torch.testing.assert_close(out, _fresh(model, prompt)[-1:], atol=1e-5, rtol=1e-5)
    # one graph for every cache size and every new cache: nothing recompiled after the first step
    assert counters["stats"]["unique_graphs"] == graphs + 1


def test_a_compiler_failure_leaves_decoding_eager(monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("InductorError: C++ compiler not found")

    monkeypatch.setattr(compiled_module.CompiledStep, "__call__", broken)
    target = loaded(make_model(seed=6))
    with caplog.at_level(logging.WARNING, logger="verispec.backends.hf"):
        assert target.compile_step() is False
    assert "decoding stays eager" in caplog.text and "C++ compiler not found" in caplog.text
    assert target.step is None and isinstance(target.new_kv(), TorchKV)
    assert len(_greedy(target, None, [5, 9, 3], n=5)) == 5


def test_compile_is_refused_where_it_was_not_measured():
    target = loaded(make_model(seed=7).to(torch.bfloat16))
    target.dtype = torch.bfloat16
    with pytest.raises(InvalidRequest, match="float32 on CPU"):
        target.compile_step()
    from verispec import load_model

    with pytest.raises(InvalidRequest, match="--compile is for float32"):  # refused before anything loads
        load_model("no-such-model", dtype="bfloat16", compiled=True)
    with pytest.raises(InvalidRequest, match="transformers backend"):
        load_model("smollm2-135m", backend="llamacpp", compiled=True)
