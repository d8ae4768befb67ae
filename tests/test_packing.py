"""Prepacked oneDNN linear weights: same numbers as nn.Linear, only faster."""

import pytest
import torch
from tiny import loaded, make_model
from transformers import DynamicCache

from verispec.engine import SpeculativeDecoder
from verispec.packing import PackedLinear, pack_linear_layers, packing_available

pytestmark = pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN")


def _pair(seed=0):
    plain = make_model(seed=seed, scale=0.1).to(torch.bfloat16)
    packed = make_model(seed=seed, scale=0.1).to(torch.bfloat16)
    n = pack_linear_layers(packed)
    return plain, packed, n


def test_packs_every_linear_of_a_bfloat16_cpu_model_and_keeps_its_weights():
    plain, packed, n = _pair()
    linears = sum(isinstance(m, torch.nn.Linear) for m in plain.modules())
    assert n == linears > 0
    assert not any(type(m) is torch.nn.Linear for m in packed.modules())
    assert sum(isinstance(m, PackedLinear) for m in packed.modules()) == n
    # the state dict is unchanged: same keys, same tensors (nothing packed leaks into a save)
    assert plain.state_dict().keys() == packed.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), packed.state_dict().values()))


def test_float32_models_are_left_alone():
    model = make_model(seed=0)
    assert pack_linear_layers(model) == 0
    assert any(type(m) is torch.nn.Linear for m in model.modules())


@torch.inference_mode()
def test_logits_are_bit_identical_at_every_width_with_a_cache():
    plain, packed, _ = _pair(seed=3)
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, 32, (1, 20), generator=gen)
    caches = DynamicCache(), DynamicCache()
    for model, cache in zip((plain, packed), caches):
        model(input_ids=prefix, past_key_values=cache, use_cache=True)
    for width in (1, 2, 5, 17, 40):
        x = torch.randint(0, 32, (1, width), generator=gen)
        a = plain(input_ids=x, past_key_values=caches[0], use_cache=True).logits
        b = packed(input_ids=x, past_key_values=caches[1], use_cache=True).logits
        assert torch.equal(a, b), width
    batch = torch.randint(0, 32, (3, 9), generator=gen)
    assert torch.equal(plain(input_ids=batch).logits, packed(input_ids=batch).logits)


def test_packed_linear_with_bias_and_gradients_falls_back_to_the_plain_op():
    layer = torch.nn.Linear(24, 40).to(torch.bfloat16)
    packed = PackedLinear(layer.weight, layer.bias)
    x = torch.randn(3, 24, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(packed(x), layer(x))
    x.requires_grad_(True)
    packed(x).float().sum().backward()  # a training caller still gets gradients
    assert x.grad is not None and layer.weight.grad is not None
    assert torch.equal(packed(x.float().to(torch.bfloat16)), layer(x.detach()))


def test_greedy_speculation_on_a_packed_target_matches_plain_decoding():
    _, packed, _ = _pair(seed=0)
    target = loaded(packed)
    target.dtype = torch.bfloat16
    from verispec.drafters.ngram import NgramDrafter

    prompt = "w5 w9 w3 w5 w9 w3 w5 w9"
    plain = SpeculativeDecoder(target, None).generate(prompt, max_new_tokens=40)
    spec = SpeculativeDecoder(target, NgramDrafter(), k=5).generate(prompt, max_new_tokens=40)
    assert spec.token_ids == plain.token_ids


def test_load_model_packs_bfloat16_by_default_and_the_switch_turns_it_off(tiny_dir, monkeypatch):
    from verispec import load_model

    assert load_model(str(tiny_dir), dtype="bfloat16").packed_layers > 0
    assert load_model(str(tiny_dir), dtype="float32").packed_layers == 0
    assert load_model(str(tiny_dir), dtype="bfloat16", pack=False).packed_layers == 0
    monkeypatch.setenv("VERISPEC_PACK", "0")
    assert load_model(str(tiny_dir), dtype="bfloat16").packed_layers == 0


def test_a_packed_model_cast_to_float32_still_computes_with_its_live_weights():
    plain, packed, _ = _pair(seed=5)
    plain, packed = plain.float(), packed.float()
    x = torch.randint(0, 32, (1, 7))
    with torch.inference_mode():
        assert torch.equal(plain(input_ids=x).logits, packed(input_ids=x).logits)
