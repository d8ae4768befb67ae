"""The growing KV cache: views into a buffer with spare room, same numbers as transformers' DynamicCache."""

import pytest
import torch
from tiny import make_model
from transformers import DynamicCache

from verispec.backends.hf import cache as cache_module
from verispec.backends.hf.cache import GrowingLayer, new_cache, truncate


@torch.inference_mode()
def test_logits_equal_dynamic_cache_bit_for_bit_through_steps_rollbacks_and_growth(monkeypatch):
    monkeypatch.setattr(cache_module, "MIN_CAPACITY", 8)  # force several reallocations in a short run
    model = make_model(seed=2)
    gen = torch.Generator().manual_seed(0)
    ours, theirs = new_cache(), DynamicCache()
    length = 0
    for width, keep in [(5, 5), (1, 6), (9, 9), (4, 10), (17, 20), (1, 21), (3, 22), (30, 50)]:
        x = torch.randint(0, 32, (1, width), generator=gen)
        a = model(input_ids=x, cache=ours, use_cache=True).logits
        b = model(input_ids=x, cache=theirs, use_cache=True).logits
        assert torch.equal(a, b)
        length += width
        keep = min(keep, length)
        truncate(ours, keep)
        truncate(theirs, keep)
        length = keep
        assert ours.get_seq_length() == theirs.get_seq_length() == keep
        for mine, ref in zip(ours.layers, theirs.layers):
            assert isinstance(mine, GrowingLayer)
            assert torch.equal(mine.keys, ref.keys) and torch.equal(mine.values, ref.values)


@torch.inference_mode()
def test_appending_after_a_rollback_writes_in_place():
    model = make_model(seed=2)
    cache = new_cache()
    model(input_ids=torch.tensor([[3, 4, 5, 6, 7]]), cache=cache, use_cache=True)
    buffer = cache.layers[0]._key_buffer
    truncate(cache, 3)
    model(input_ids=torch.tensor([[8, 9]]), cache=cache, use_cache=True)
    assert cache.layers[0]._key_buffer is buffer  # no new allocation, no copy of the cached positions
    assert cache.layers[0].keys.data_ptr() == buffer.data_ptr() and cache.get_seq_length() == 5


@torch.inference_mode()
def test_reset_and_replaced_tensors_are_handled():
    model = make_model(seed=2)
    cache = new_cache()
    model(input_ids=torch.tensor([[3, 4, 5]]), cache=cache, use_cache=True)
    cache.reset()
    assert cache.get_seq_length() == 0
    ref = DynamicCache()
    x = torch.tensor([[6, 7, 8, 9]])
    assert torch.equal(model(input_ids=x, cache=cache, use_cache=True).logits,
                       model(input_ids=x, cache=ref, use_cache=True).logits)
    for layer in cache.layers:  # e.g. a batch reorder replaces the tensors: the next update moves them back in
        layer.keys, layer.values = layer.keys.clone(), layer.values.clone()
    y = torch.tensor([[10, 11]])
    assert torch.equal(model(input_ids=y, cache=cache, use_cache=True).logits,
                       model(input_ids=y, cache=ref, use_cache=True).logits)


def test_truncate_refuses_to_grow():
    cache = new_cache()
    with pytest.raises(ValueError, match="cannot truncate"):
        truncate(cache, 3)


@torch.inference_mode()
def test_emptying_the_cache_again_and_again_keeps_one_buffer():
    """A one-token prompt prefills nothing, and every verify pass is then rolled back to an empty cache. Refilling
    an emptied cache once doubled its buffer each time, until an allocation of 34 GB failed (found by the schema
    fuzz run, tests/test_api_contract.py); the emptied cache now reuses its buffer."""
    model = make_model(seed=2)
    cache = new_cache()
    for width in [1, 2, 5, 9] * 10:
        model(input_ids=torch.zeros(1, width, dtype=torch.long), cache=cache, use_cache=True)
        truncate(cache, 0)
    assert cache.layers[0]._key_buffer.shape[-2] == cache_module.MIN_CAPACITY
    model(input_ids=torch.zeros(1, 300, dtype=torch.long), cache=cache, use_cache=True)  # grows once
    assert cache.layers[0]._key_buffer.shape[-2] == 2 * cache_module.MIN_CAPACITY
