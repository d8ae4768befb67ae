"""Grouped-query attention without copied heads (verispec.backends.hf.attention): the same bits as transformers' SDPA
in every kind of pass the engine runs, without ``repeat_kv``'s copy of the cache."""

import pytest
import torch
import transformers.integrations.sdpa_attention as sdpa_module

from tiny import loaded, make_model
from verispec.backends.hf import load
from verispec.backends.hf.attention import GROUPED_SDPA, use_grouped_sdpa


def pair(dtype=torch.float32):
    """The tiny model (4 query heads on 2 key/value heads) twice: transformers' SDPA, and grouped."""
    plain, grouped = make_model(seed=0).to(dtype), make_model(seed=0).to(dtype)
    assert use_grouped_sdpa(grouped) and grouped.config._attn_implementation == GROUPED_SDPA
    return loaded(plain), loaded(grouped)


@pytest.fixture
def repeats(monkeypatch):
    """How often transformers copies key/value heads."""
    calls = []
    original = sdpa_module.repeat_kv
    monkeypatch.setattr(sdpa_module, "repeat_kv", lambda x, n: calls.append(n) or original(x, n))
    return calls


PROMPT = [5, 9, 3, 5, 9, 12, 7, 7, 30, 2, 4]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chain_passes_over_a_cache_are_bitwise_transformers_sdpa_without_copies(repeats, dtype):
    plain, grouped = pair(dtype)
    outs = {}
    for name, target in (("plain", plain), ("grouped", grouped)):
        kv = target.new_kv()
        first = target.forward(kv, PROMPT, feature_layers=(1, 2))
        passes = [target.forward(kv, [8, 6, 1, 22], feature_layers=(1, 2)), target.forward(kv, [3])]
        kv.truncate(len(PROMPT) + 2)  # a rollback, then a wider pass over the shorter cache
        passes.append(target.forward(kv, [17, 5, 5, 9, 10, 11], feature_layers=(1, 2)))
        outs[name] = [first, *passes]
        if name == "plain":
            assert repeats, "the test's premise: transformers copies heads in masked multi-token passes"
            repeats.clear()
    assert not repeats  # the grouped model never copied a head
    for a, b in zip(outs["plain"], outs["grouped"]):
        assert torch.equal(a.logits, b.logits)
        assert (a.hidden is None and b.hidden is None) or torch.equal(a.hidden, b.hidden)


def test_tree_passes_are_bitwise_transformers_sdpa(repeats):
    plain, grouped = pair()
    parents = [-1, -1, 0, 0, 2, 1]
    outs, copies = [], []
    for target in (plain, grouped):
        kv = target.new_kv(trees=True)
        target.forward(kv, PROMPT)
        outs.append(target.forward(kv, [4, 8, 1, 22, 3, 9, 12], parents=parents))
        copies.append(len(repeats))
    assert torch.equal(outs[0].logits, outs[1].logits)
    assert copies[0] > 0 and copies[1] == copies[0]  # the grouped pass added none


def test_batched_passes_are_bitwise_transformers_sdpa(repeats):
    plain, grouped = pair()
    outs, copies = [], []
    for target in (plain, grouped):
        group = target.new_kv_group(3)
        kvs = [group.new_kv() for _ in range(3)]
        target.forward_batch([(kvs[0], PROMPT), (kvs[1], PROMPT[:4]), (kvs[2], [7, 7, 7])])
        outs.append(target.forward_batch([(kvs[0], [3, 4]), (kvs[1], [9, 8, 7, 6]), (kvs[2], [1])]))
        copies.append(len(repeats))
    for a, b in zip(*outs):
        assert torch.equal(a.logits, b.logits)
    assert copies[0] > 0 and copies[1] == copies[0]


def test_load_uses_it_for_float32_cpu_models(tiny_dir):
    target = load(str(tiny_dir), dtype="float32")
    assert target.model.config._attn_implementation == GROUPED_SDPA
    other = make_model(seed=0)
    other.set_attn_implementation("eager")
    assert not use_grouped_sdpa(other) and other.config._attn_implementation == "eager"
