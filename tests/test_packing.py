"""Prepacked oneDNN linear weights, used only where this CPU runs them; every path is exercised on any CPU:
float32 packing (oneDNN's float32 kernel runs on any x86-64 CPU), bfloat16 packing where the CPU has it, and the
fallback on a CPU without the kernel (simulated everywhere by a kernel that raises, as it does on an AVX2 CPU)."""

import pytest
import torch
from tiny import loaded, make_model

from verispec.backends.torch_cpu import cpu
from verispec.backends.hf.cache import new_cache
from verispec.drafters.ngram import NgramDrafter
from verispec.engine import SpeculativeDecoder
from verispec.backends.torch_cpu.packing import PackedLinear, pack_linear_layers, packing_available

AVX2_ERROR = ("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert or avx512bw, avx512vl "
              "and avx512dq")
needs_onednn = pytest.mark.skipif(not cpu._packed_ops_exist(), reason="this torch build has no oneDNN")
needs_bf16_packing = pytest.mark.skipif(
    not packing_available(torch.bfloat16),
    reason=f"this CPU ({cpu.cpu_info()['model']}, {cpu.cpu_info()['torch_capability']}) cannot run oneDNN's packed "
           "bfloat16 kernel; the fallback tests below cover it")


@pytest.fixture
def cpu_without_packed_kernels(monkeypatch):
    """A CPU whose oneDNN refuses the packed kernel, as an AVX2-only CPU does for bfloat16 (simulated)."""
    def refuse(*args, **kwargs):
        raise RuntimeError(AVX2_ERROR)

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse)
    cpu.packed_linear_works.cache_clear()
    yield
    cpu.packed_linear_works.cache_clear()


def _pair(dtype, seed=0):
    plain = make_model(seed=seed, scale=0.1).to(dtype)
    packed = make_model(seed=seed, scale=0.1).to(dtype)
    return plain, packed, pack_linear_layers(packed)


# ------------------------------------------------------------------ the probe
def test_probe_agrees_with_the_cpu_flags():
    flags = set(cpu.cpu_info()["flags"])
    if cpu._packed_ops_exist() and ({"avx512bw", "avx512vl", "avx512dq"} <= flags or "avx_ne_convert" in flags):
        assert packing_available(torch.bfloat16)
    if cpu._packed_ops_exist() and "avx2" in flags:
        assert packing_available(torch.float32)
    assert not packing_available(torch.float16)  # never packed: not a dtype this module handles


def test_probe_says_no_when_the_kernel_raises(cpu_without_packed_kernels):
    assert not cpu.packed_linear_works(torch.bfloat16)
    assert not cpu.packed_linear_works(torch.float32)
    assert "cannot run the packed kernel" in cpu.linear_kernel(torch.bfloat16)


def test_cpu_info_names_the_cpu_and_what_torch_dispatches():
    info = cpu.cpu_info()
    assert info["model"] and info["torch_capability"]
    assert set(info["flags"]) <= set(cpu.ISA_FLAGS)


# ------------------------------------------------------------------ the fallback, on any CPU
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_without_the_kernel_nothing_is_packed_and_the_model_runs(cpu_without_packed_kernels, dtype):
    plain, packed, n = _pair(dtype)
    assert n == 0 and not any(isinstance(m, PackedLinear) for m in packed.modules())
    x = torch.randint(0, 32, (1, 9))
    with torch.inference_mode():
        assert torch.equal(plain(input_ids=x).logits, packed(input_ids=x).logits)


def test_load_model_falls_back_on_a_cpu_without_the_kernel(cpu_without_packed_kernels, tiny_dir):
    from verispec import load_model

    target = load_model(str(tiny_dir), dtype="bfloat16")
    assert target.packed_layers == 0 and "cannot run the packed kernel" not in target.linear_kernel
    out = SpeculativeDecoder(target, NgramDrafter(), k=4, k_policy="fixed").generate("w5 w9 w3 w5 w9", max_new_tokens=12)
    assert out.stats.new_tokens == 12


# ------------------------------------------------------------------ float32 packing (any x86-64 CPU)
@needs_onednn
def test_packs_every_linear_of_a_float32_model_and_keeps_its_weights():
    plain, packed, n = _pair(torch.float32)
    assert n == sum(isinstance(m, torch.nn.Linear) for m in plain.modules()) > 0
    assert not any(type(m) is torch.nn.Linear for m in packed.modules())
    # the state dict is unchanged: same keys, same tensors (nothing packed leaks into a save)
    assert plain.state_dict().keys() == packed.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), packed.state_dict().values()))


@needs_onednn
@torch.inference_mode()
def test_float32_packed_rows_do_not_depend_on_the_pass_width():
    """oneDNN's packed float32 rows are the same whatever else is in the pass (MKL's change between 16 and 17 rows)."""
    weight = torch.randn(200, 48, generator=torch.Generator().manual_seed(0))
    layer = PackedLinear(weight)
    x = torch.randn(1, 64, 48, generator=torch.Generator().manual_seed(1))
    full = layer(x)
    for rows in (1, 2, 5, 9, 16, 17, 33):
        assert torch.equal(layer(x[:, :rows]), full[:, :rows]), rows


@needs_onednn
@torch.inference_mode()
def test_float32_packed_logits_stay_as_close_to_plain_at_every_width():
    plain, packed, _ = _pair(torch.float32, seed=3)
    tokens = torch.randint(0, 32, (1, 60), generator=torch.Generator().manual_seed(0))
    wide = plain(input_ids=tokens).logits
    assert torch.allclose(packed(input_ids=tokens).logits, wide, rtol=1e-4, atol=1e-5)
    cache = new_cache()
    packed(input_ids=tokens[:, :20], cache=cache, use_cache=True)
    position = 20
    for width in (1, 2, 5, 17, 15):  # steps of several widths over the same sequence
        step = packed(input_ids=tokens[:, position : position + width], cache=cache, use_cache=True).logits
        assert torch.allclose(step[0], wide[0, position : position + width], rtol=1e-4, atol=1e-5), width
        position += width


@needs_onednn
def test_greedy_speculation_on_a_packed_float32_target_matches_plain_decoding():
    _, packed, _ = _pair(torch.float32)
    target = loaded(packed)
    prompt = "w5 w9 w3 w5 w9 w3 w5 w9"
    plain = SpeculativeDecoder(target, None).generate(prompt, max_new_tokens=40)
    spec = SpeculativeDecoder(target, NgramDrafter(), k=5, k_policy="fixed").generate(prompt, max_new_tokens=40)
    assert spec.token_ids == plain.token_ids and spec.stats.accepted > 0


@needs_onednn
def test_packed_linear_with_bias_and_gradients_falls_back_to_the_plain_op():
    layer = torch.nn.Linear(24, 40)
    packed = PackedLinear(layer.weight, layer.bias)
    x = torch.randn(3, 24)
    with torch.inference_mode():
        assert torch.allclose(packed(x), layer(x), atol=1e-6)
    x.requires_grad_(True)
    packed(x).sum().backward()  # a training caller still gets gradients
    assert x.grad is not None and layer.weight.grad is not None
    assert torch.equal(packed(x), layer(x))  # with gradients: the plain op itself


@needs_onednn
def test_load_model_packs_by_default_and_the_switch_turns_it_off(tiny_dir, monkeypatch):
    from verispec import load_model

    assert load_model(str(tiny_dir), dtype="float32").packed_layers > 0
    assert load_model(str(tiny_dir), dtype="float32").linear_kernel == "oneDNN-packed"
    assert load_model(str(tiny_dir), dtype="bfloat16").packed_layers == (
        load_model(str(tiny_dir), dtype="float32").packed_layers if packing_available(torch.bfloat16) else 0)
    off = load_model(str(tiny_dir), dtype="float32", pack=False)
    assert off.packed_layers == 0 and "packing off" in off.linear_kernel
    monkeypatch.setenv("VERISPEC_PACK", "0")
    assert load_model(str(tiny_dir), dtype="float32").packed_layers == 0


@needs_onednn
def test_a_packed_float32_model_cast_to_bfloat16_computes_with_its_live_weights():
    plain, packed, _ = _pair(torch.float32, seed=5)
    plain, packed = plain.to(torch.bfloat16), packed.to(torch.bfloat16)
    x = torch.randint(0, 32, (1, 7))
    with torch.inference_mode():
        assert torch.equal(plain(input_ids=x).logits, packed(input_ids=x).logits)


# ------------------------------------------------------------------ bfloat16 packing (CPUs that have it)
@needs_bf16_packing
@torch.inference_mode()
def test_bfloat16_packed_logits_are_bit_identical_at_every_width_with_a_cache():
    plain, packed, n = _pair(torch.bfloat16, seed=3)
    assert n > 0
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, 32, (1, 20), generator=gen)
    caches = new_cache(), new_cache()
    for model, cache in zip((plain, packed), caches):
        model(input_ids=prefix, cache=cache, use_cache=True)
    for width in (1, 2, 5, 17, 40):
        x = torch.randint(0, 32, (1, width), generator=gen)
        a = plain(input_ids=x, cache=caches[0], use_cache=True).logits
        b = packed(input_ids=x, cache=caches[1], use_cache=True).logits
        assert torch.equal(a, b), width
    batch = torch.randint(0, 32, (3, 9), generator=gen)
    assert torch.equal(plain(input_ids=batch).logits, packed(input_ids=batch).logits)


@needs_bf16_packing
def test_greedy_speculation_on_a_packed_bfloat16_target_matches_plain_decoding():
    _, packed, _ = _pair(torch.bfloat16)
    target = loaded(packed)
    target.dtype = torch.bfloat16
    prompt = "w5 w9 w3 w5 w9 w3 w5 w9"
    plain = SpeculativeDecoder(target, None).generate(prompt, max_new_tokens=40)
    spec = SpeculativeDecoder(target, NgramDrafter(), k=5, k_policy="fixed").generate(prompt, max_new_tokens=40)
    assert spec.token_ids == plain.token_ids
