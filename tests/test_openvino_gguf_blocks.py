"""The OpenVINO backend on a GGUF file's own quantized blocks (``--weights as-is``): every block type decodes to the
values ``gguf``'s reader dequantizes; tiny models quantized by llama.cpp itself (Q4_0, and Q4_K_M, whose matrices are
Q4_K and Q6_K) export with every matrix held in its own type, give the dequantized model's logits, and decode
greedily with speculation exactly as without."""

import ctypes
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import require_llama_cpp, require_openvino

from verispec.backends.openvino.gguf_blocks import DECODERS, Blocks, decode

# llama.cpp file types (llama_ftype) the tests quantize to; Q4_1 and Q8_0 (the built-in file's matrices and
# embeddings) are covered on the real model by tests/test_e2e_openvino.py, and every type's decoding above
FTYPES = {"q4_0": 2, "q4_k_m": 15}
# what each file type must hold (hidden 256, so that Q4_K_M's K-quant super-blocks fit a row)
EXPECTED = {"q4_0": {"Q4_0"}, "q4_k_m": {"Q4_K", "Q6_K"}}


def _random_blocks(kind: str, rows: int, blocks: int, seed: int) -> np.ndarray:
    """Random bytes in ``kind``'s block layout with finite float16 factors (some of them 0)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    _, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, blocks, size), dtype=np.uint8)
    factors = {"Q4_1": [0, 2], "Q5_1": [0, 2], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}.get(kind, [0])
    for offset in factors:
        values = (rng.uniform(0.001, 0.1, (rows, blocks)) * rng.choice([-1, 1], (rows, blocks))).astype(np.float16)
        values[0, 0] = 0  # a block whose scale is 0
        raw[..., offset:offset + 2] = values.view(np.uint8).reshape(rows, blocks, 2)
    return raw.reshape(rows, blocks * size)


@pytest.mark.parametrize("kind", sorted(DECODERS))
def test_every_block_type_holds_the_values_gguf_dequantizes(kind):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    raw = _random_blocks(kind, rows=6, blocks=3, seed=len(kind))
    want = dequantize(raw, GGMLQuantizationType[kind]).reshape(6, -1)
    blocks = decode(kind, raw)
    assert isinstance(blocks, Blocks) and blocks.bits in (4, 8)
    assert blocks.q.shape[0] * blocks.q.shape[1] * blocks.q.shape[2] == want.size
    if blocks.bits == 4:
        assert blocks.q.max() < 16  # fits OpenVINO's u4
    # symmetric types and the float16 scales are exact; a zero point of -m/d is a float32 rounding away
    tol = 0 if kind in ("Q4_0", "Q5_0", "Q8_0", "Q6_K") else 4 * np.finfo(np.float32).eps
    assert np.abs(blocks.values() - want).max() <= tol * np.abs(want).max()
    picked = blocks.take(np.array([4, 1]))
    np.testing.assert_array_equal(picked.values(), blocks.values()[[4, 1]])


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """{file type: (its .gguf, the F32 .gguf it was quantized from)}: a tiny llama (hidden 256, so that K-quant
    super-blocks fit a row) written by llama.cpp's converter and quantized by llama.cpp's own quantizer."""
    llama_cpp = require_llama_cpp()
    require_openvino()
    from transformers import AutoTokenizer

    from verispec.backends.references import DEFAULT_MODEL, resolve
    from zoo import zoo_gguf

    tokenizer = AutoTokenizer.from_pretrained(str(resolve(DEFAULT_MODEL)))
    root = tmp_path_factory.mktemp("gguf-blocks")
    source = zoo_gguf("llama", tokenizer, root / "tiny", hidden_size=256, intermediate_size=512,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    files = {}
    for name, ftype in FTYPES.items():
        out = root / f"tiny-{name}.gguf"
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = ftype
        params.nthread = 2
        assert llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params)) == 0
        files[name] = out
    return files


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VERISPEC_CACHE", str(tmp_path_factory.mktemp("ov-gguf-cache")))
        yield


@pytest.mark.parametrize("ftype", list(FTYPES))
def test_as_is_holds_every_matrix_in_its_own_block_type_and_gives_the_files_logits(quantized, cache, ftype):
    from gguf import GGUFReader

    from verispec import load_model

    path = quantized[ftype]
    target = load_model(str(path), backend="openvino", threads=1, static_widths=())  # as-is: the default for a .gguf source
    assert target.weights == "as-is"
    record = json.loads((target.folder / "verispec_export.json").read_text())
    held = record["gguf_blocks"]["verispec_model.xml"]
    assert held["float32"] == []  # every matrix found in the file
    in_file = {t.tensor_type.name for t in GGUFReader(str(path)).tensors if len(t.shape) == 2}
    assert EXPECTED[ftype] <= set(held["kinds"]) <= in_file | {"F16"}
    # the graph's weight constants are the file's integers, not float32 matrices
    import openvino as ov

    graph = ov.Core().read_model(str(target.folder / "verispec_model.xml"))
    kinds = {op.get_element_type().get_type_name() for op in graph.get_ops() if op.get_type_name() == "Constant"
             and len(op.get_output_shape(0)) == 3}
    assert kinds & {"u4", "u8", "i8"}, kinds

    # the file's values, dequantized, in float32 on transformers: the same model up to rounding
    reference = load_model(str(path))
    ids = [int(i) for i in torch.randint(5, 4000, (40,), generator=torch.Generator().manual_seed(3))]
    want = reference.forward(reference.new_kv(), ids).logits
    got = target.forward(target.new_kv(), ids).logits
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.95
    torch.testing.assert_close(got, want, atol=0.05 * want.abs().max().item(), rtol=0)


def test_greedy_speculation_on_the_files_blocks_is_plain_decoding(quantized, cache):
    from verispec import NgramDrafter, SpeculativeDecoder, load_model
    from verispec.drafters import SuffixDrafter

    target = load_model(str(quantized["q4_k_m"]), backend="openvino", threads=1, static_widths=(2, 4, 8))
    target.eos_token_ids = frozenset()  # random weights: answers run to the limit
    prompt = "one two three one two three one two three one two"
    plain = SpeculativeDecoder(target, None).generate(prompt, max_new_tokens=40, raw=True).token_ids
    for drafter in (NgramDrafter(), SuffixDrafter()):
        out = SpeculativeDecoder(target, drafter, k=6, k_policy="fixed").generate(prompt, max_new_tokens=40, raw=True)
        assert out.token_ids == plain
        assert out.stats.drafted > 0


def test_as_is_on_a_transformers_folder_is_its_float32_weights(tiny_dir, cache):
    require_openvino()
    from verispec import load_model

    assert load_model(str(tiny_dir), backend="openvino", threads=1).weights == "fp32"
