"""The blocks backend on tiny random models whose matrices are quantized to GGUF blocks (gguf's own quantizer):
every linear layer runs on the blocks, logits stay close to the float model holding the same values, a wide pass's
rows equal one-token steps bit for bit, and greedy speculation equals plain decoding with every kind of drafter."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from verispec import SpeculativeDecoder, blockmm
from verispec.backends.block_modules import BlockLinear, RowRMSNorm
from verispec.backends.blocks import BlocksModel, on_blocks, swap_norms
from verispec.backends.openvino.gguf_blocks import GGUFRows
from verispec.drafters import ModelDrafter, NgramDrafter

from tiny import loaded, make_model, noisy_copy

pytestmark = pytest.mark.skipif(not blockmm.available(), reason=str(blockmm.why_unavailable()))


def quantized(model, kinds=("Q8_0", "Q4_0", "Q4_1", "Q5_0")) -> GGUFRows:
    """Quantize each linear layer of ``model`` (in place: it then holds the blocks' values) to a GGUF type, cycling
    through ``kinds``; the blocks as a file's rows would be found."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    rows = GGUFRows(path=None)
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    for i, (name, linear) in enumerate(linears):
        kind = kinds[i % len(kinds)]
        raw = quantize(linear.weight.detach().float().numpy(), GGMLQuantizationType[kind])
        values = dequantize(raw, GGMLQuantizationType[kind]).reshape(linear.weight.shape)
        with torch.no_grad():
            linear.weight.copy_(torch.from_numpy(values))
        rows.add(name, kind, np.ascontiguousarray(raw), values)
    return rows


@pytest.fixture(scope="module")
def pair():
    """(the float model holding the blocks' values, the same model on the blocks backend)."""
    float_model = loaded(make_model(seed=3, layers=2))
    rows = quantized(float_model.model)
    blocks_model = loaded(make_model(seed=3, layers=2))
    blocks_model.model.load_state_dict(float_model.model.state_dict())
    return float_model, on_blocks(blocks_model, rows)


def test_every_linear_runs_on_blocks(pair):
    _, model = pair
    assert isinstance(model, BlocksModel) and model.backend == "blocks" and model.width_invariant
    assert not [m for m in model.model.modules() if isinstance(m, torch.nn.Linear)]
    assert sum(model.swapped.kinds.values()) == len([m for m in model.model.modules() if isinstance(m, BlockLinear)])
    assert set(model.swapped.kinds) == {"Q8_0", "Q4_0", "Q4_1", "Q5_0"}
    assert "blocks" in model.linear_kernel or "block kernel" in model.linear_kernel
    head = model.model.get_output_embeddings()
    assert torch.equal(head.weight, pair[0].model.get_output_embeddings().weight)  # dequantized on demand
    assert model.vocab_size == pair[0].vocab_size


def test_rms_norms_run_on_the_native_kernel_where_they_compute_its_formula(pair):
    _, model = pair
    assert len([m for m in model.model.modules() if isinstance(m, RowRMSNorm)]) == 2 * 2 + 1  # two a layer, the last
    assert not [m for m in model.model.modules() if type(m).__name__ == "LlamaRMSNorm"]

    class OffsetRMSNorm(torch.nn.Module):  # Gemma's form, weight * (1 + w): must keep its own forward
        def __init__(self):
            super().__init__()
            self.weight, self.variance_epsilon = torch.nn.Parameter(torch.randn(16)), 1e-6

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon) * (1 + self.weight)

    holder = torch.nn.Sequential(OffsetRMSNorm())
    assert swap_norms(holder) == 0 and isinstance(holder[0], OffsetRMSNorm)


@torch.inference_mode()
def test_decoder_layers_take_the_lean_forward_with_the_same_bits(pair):
    from verispec.backends.block_layers import LeanForward

    _, model = pair
    layers = model.model.model.layers
    assert all(isinstance(layer.__dict__.get("forward"), LeanForward) for layer in layers)
    tokens, more = [1, 5, 9, 3, 7], [12, 4, 30]
    got = []
    for lean in (True, False):
        saved = [layer.__dict__.pop("forward") for layer in layers] if not lean else None
        kv = model.new_kv()
        got.append((model.forward(kv, tokens).logits, model.forward(kv, more).logits))
        for layer, forward in zip(layers, saved or ()):
            layer.forward = forward
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])


@torch.inference_mode()
def test_the_native_layer_front_gives_the_lean_forwards_bits_on_every_kind_of_pass(pair):
    """Each layer runs as one native call (``block_step.NativeFront``, its MLP too): a sequence's chain passes,
    a token tree's nodes and a batch's ragged rows give the bits of the lean forward's Python steps, and leave the
    same keys and values in the cache (the passes after read them)."""
    _, model = pair
    leans = [layer.__dict__["forward"] for layer in model.model.model.layers]
    fronts = [lean.front for lean in leans]
    from verispec.backends.block_step import silu_matches

    assert all(front is not None for front in fronts)
    # the whole layer (64 MLP units: whole vectors), wherever torch's SiLU is its vectorized SLEEF loop (every x86 CPU
    # with AVX2)
    assert all(front.back == silu_matches() for front in fronts) and (silu_matches() or blockmm.best_isa() == "scalar")

    def passes():
        kv = model.new_kv()
        out = [model.forward(kv, [1, 5, 9, 3, 7]).logits, model.forward(kv, [12]).logits,
               model.forward(kv, [4, 30, 2, 8], parents=[-1, 0, 0, 2]).logits]
        kv.truncate(6)
        out.append(model.forward(kv, [4, 30]).logits)
        group = model.new_kv_group(3)
        kvs = [group.new_kv() for _ in range(3)]
        out += model.forward_batch([(kvs[0], [1, 5, 9, 3]), (kvs[1], [2, 6]), (kvs[2], [7])])
        out += model.forward_batch([(kvs[0], [3, 4]), (kvs[2], [9, 8, 7]), (kvs[1], [1])])
        return [o.logits if hasattr(o, "logits") else o for o in out]

    served = sum(front.passes for front in fronts)
    stack, model.stack = model.stack, None  # each layer its own call (the stack: the next test)
    try:
        native = passes()
        assert sum(front.passes for front in fronts) == served + 6 * len(fronts)  # every pass took the native call
        for lean in leans:
            lean.front = None
        python = passes()
    finally:
        model.stack = stack
        for lean, front in zip(leans, fronts):
            lean.front = front
    assert len(native) == len(python) == 10
    for i, (a, b) in enumerate(zip(native, python)):
        assert torch.equal(a, b), i


def test_the_decoder_layers_in_one_native_call_give_each_layers_own_calls_bits(pair):
    """The whole pass with every decoder layer in one native call (``block_stack.NativeStack``): a sequence's chain
    passes (logits of every row and of the last only), a token tree's nodes after a rollback and a batch's ragged rows
    give the bits of the layers' own calls, and leave the same cache; a view without some layers (layer skipping) and
    a pass asking for hidden states run through transformers."""
    _, model = pair
    assert model.stack is not None and model.stack.model is model.model

    def passes():
        kv = model.new_kv()
        out = [model.forward(kv, [1, 5, 9, 3, 7]).logits, model.forward(kv, [12]).logits,
               model.forward(kv, [4, 30, 2, 8], parents=[-1, 0, 0, 2]).logits]
        kv.truncate(6)
        out += [model.forward(kv, [4, 30]).logits, model.forward(kv, [4, 30, 5], last_only=True).logits]
        out.append(model.forward(kv, [6, 2], feature_layers=(1,)).hidden)
        group = model.new_kv_group(3)
        kvs = [group.new_kv() for _ in range(3)]
        out += [p.logits for p in model.forward_batch([(kvs[0], [1, 5, 9, 3]), (kvs[1], [2, 6]), (kvs[2], [7])])]
        out += [p.logits for p in model.forward_batch([(kvs[0], [3, 4]), (kvs[2], [9, 8, 7]), (kvs[1], [1])],
                                                      last_only=True)]
        view = model.without_layers([1])
        out.append(view.forward(view.new_kv(), [3, 1, 4]).logits)
        out += [layer.keys for layer in kv.cache.layers]
        return out

    before = model.stack.passes
    native = passes()
    assert model.stack.passes == before + 7  # all but the hidden states' pass and the view's
    stack, model.stack = model.stack, None
    try:
        python = passes()
    finally:
        model.stack = stack
    assert len(native) == len(python)
    for i, (a, b) in enumerate(zip(native, python)):
        assert torch.equal(a, b), i


def test_the_native_layers_call_refuses_bad_records_with_a_clear_error():
    from verispec.blockmm import _native

    records = torch.zeros(1, 13, dtype=torch.int64)
    with pytest.raises(ValueError, match="null pointer"):
        _native.layers(1, 1, 1, 1, 64, 4, 2, 16, 1e-6, 0.25, records.data_ptr(), 1, 0, 0, 0, 0, 0, 0, 0, 1)
    with pytest.raises(ValueError, match="at least one layer"):
        _native.layers(1, 1, 1, 1, 64, 4, 2, 16, 1e-6, 0.25, records.data_ptr(), 0, 0, 0, 0, 0, 0, 0, 0, 1)


def test_the_native_layer_front_refuses_bad_shapes_with_a_clear_error():
    from verispec.blockmm import _native

    with pytest.raises(ValueError, match="bad layer shape"):
        _native.layer_front(0, 1, 1, 64, 4, 3, 16, 1e-6, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                            1.0, 1, 0, 0)


@torch.inference_mode()
def test_siblings_in_one_block_type_run_as_one_product_over_joined_rows():
    float_model = loaded(make_model(seed=5, layers=2))
    rows = quantized(float_model.model, kinds=("Q8_0",))
    model = on_blocks(float_model, rows)
    for layer in model.model.model.layers:
        lean, attn = layer.__dict__["forward"], layer.self_attn
        (matrix, bias, sizes), = lean.qkv.runs
        assert sizes == [attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features]
        assert matrix.blocks.data_ptr() == attn.q_proj.blocks.data_ptr()  # a view of the three, not a copy
        assert len(lean.gate_up.runs) == 1
    # a joined product computes each column as alone: a wide pass's rows still equal one-token steps
    kv = model.new_kv()
    model.forward(kv, [1, 5, 9], last_only=True)
    wide = model.forward(kv, [4, 8, 2]).logits
    kv.truncate(3)
    assert all(torch.equal(wide[i], model.forward(kv, [t]).logits[-1]) for i, t in enumerate([4, 8, 2]))


def test_a_layer_computing_something_else_keeps_its_own_forward():
    from verispec.backends.block_layers import install

    float_model = loaded(make_model(seed=6, layers=2))
    model = on_blocks(float_model, quantized(float_model.model))
    layers = model.model.model.layers
    for layer in layers:
        layer.__dict__.pop("forward")
    layers[1].mlp.act_fn = torch.nn.GELU()  # not the SiLU the lean forward computes: its probe must refuse it
    assert install(model.model) == 1
    assert "forward" in layers[0].__dict__ and "forward" not in layers[1].__dict__


@torch.inference_mode()
def test_logits_close_to_the_float_model(pair):
    float_model, model = pair
    tokens = [1, 5, 9, 3, 7, 11, 4, 8, 20, 6]
    want = float_model.forward(float_model.new_kv(), tokens).logits
    got = model.forward(model.new_kv(), tokens).logits
    assert (got - want).abs().max() < 0.05 * want.abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.8


@torch.inference_mode()
def test_wide_pass_rows_equal_one_token_steps(pair):
    _, model = pair
    prompt = [1, 5, 9, 3, 7]
    steps = [12, 4, 30, 8, 8, 2, 17, 25]
    kv = model.new_kv()
    model.forward(kv, prompt, last_only=True)
    wide = model.forward(kv, steps).logits
    kv.truncate(len(prompt))
    narrow = [model.forward(kv, [t]).logits[-1] for t in steps]
    for i, row in enumerate(narrow):
        assert torch.equal(wide[i], row), i


@pytest.mark.parametrize("k", [1, 3, 8])
def test_greedy_speculation_equals_plain(pair, k):
    _, model = pair
    prompt = "w5 w6 w7 w5 w6 w7 w5 w6"
    plain = SpeculativeDecoder(model, None).generate(prompt, max_new_tokens=40, raw=True).token_ids
    ngram = SpeculativeDecoder(model, NgramDrafter(), k=k, k_policy="fixed").generate(prompt, max_new_tokens=40, raw=True)
    assert ngram.token_ids == plain
    draft = loaded(noisy_copy(pair[0].model, noise=0.05), model.tokenizer, name="draft")
    drafted = SpeculativeDecoder(model, ModelDrafter(draft, model), k=k, k_policy="fixed").generate(
        prompt, max_new_tokens=40, raw=True)
    assert drafted.token_ids == plain
    assert drafted.stats.accepted > 0  # the drafts were verified, not skipped


def test_greedy_token_trees_equal_plain(pair):
    _, model = pair
    prompt = "w5 w6 w7 w5 w6 w8 w5 w6 w7 w5"
    plain = SpeculativeDecoder(model, None).generate(prompt, max_new_tokens=40, raw=True).token_ids
    trees = SpeculativeDecoder(model, NgramDrafter(branches=3), k=6, k_policy="fixed")
    got = trees.generate(prompt, max_new_tokens=40, raw=True)
    assert got.token_ids == plain and got.stats.drafted > 0


def test_unsupported_file_is_refused_by_name():
    from verispec.errors import InvalidRequest

    model = loaded(make_model(seed=4))
    with pytest.raises(InvalidRequest, match="none of its matrices"):
        on_blocks(model, GGUFRows(path=None), name="empty.gguf")


def test_a_candidate_of_auto_for_gguf_files_where_the_kernel_runs(tiny_dir, monkeypatch):
    from verispec import blockmm
    from verispec.backends.choice import candidates

    assert ("blocks" in candidates("smollm2-135m")) == blockmm.available()
    assert "blocks" not in candidates(str(tiny_dir))  # a transformers folder: no file blocks to run
    monkeypatch.setattr(blockmm, "available", lambda: False)  # a CPU without AVX2, or no native build
    assert "blocks" not in candidates("smollm2-135m")


def test_the_read_bandwidth_is_the_faster_of_its_two_reads_and_leaves_torchs_threads(monkeypatch):
    """The floor's bandwidth: the faster of a sum and a matrix-vector product over the buffer (the sum alone had
    read slower than the kernel's own passes on a Sapphire Rapids); torch's thread count restored. A fake clock:
    each sum takes 2 s, each product 1 s."""
    import torch

    from verispec.backends import timing

    now = [0.0]
    real_sum, real_mv = torch.Tensor.sum, torch.mv

    def timed(seconds, real):
        def run(*args, **kwargs):
            now[0] += seconds
            return real(*args, **kwargs)
        return run

    monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(torch.Tensor, "sum", timed(2.0, real_sum))
    monkeypatch.setattr(torch, "mv", timed(1.0, real_mv))
    before = torch.get_num_threads()
    nbytes = int(0.01 * 2**30) // (4 * 4096) * 4096 * 4  # whole rows of 4,096 floats
    assert timing.read_bandwidth(1, gigabytes=0.01, rounds=2) == pytest.approx(nbytes / 1.0)
    assert torch.get_num_threads() == before
    monkeypatch.setattr(torch, "mv", timed(3.0, real_mv))  # a slower product: the sum's rate
    assert timing.read_bandwidth(1, gigabytes=0.01, rounds=2) == pytest.approx(nbytes / 2.0)


def test_costs_command_prints_each_engines_curve(tiny_dir, capsys, tmp_path):
    import json

    from verispec.cli import main

    chart = tmp_path / "costs.png"
    assert main(["costs", "--target", str(tiny_dir), "--backends", "transformers", "--widths", "2,1",
                 "--repeats", "1", "--context", "8", "--plot", str(chart)]) == 0
    out = capsys.readouterr().out
    summary = json.loads(out.strip().splitlines()[-1])
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"chart: {chart}" in out
    assert summary["floor_ms"] is None  # a folder: no file whose bytes a pass reads
    assert list(summary["engines"]["transformers"]["ms"]) == ["1", "2"]
    assert "| transformers | " in out and "(1.00)" in out
    assert main(["costs", "--target", str(tiny_dir), "--widths", "a,b"]) == 2
    assert "--widths takes comma-separated integers" in capsys.readouterr().err
    assert main(["costs", "--target", str(tiny_dir), "--plot", str(tmp_path / "no" / "c.png")]) == 2
    assert "no folder" in capsys.readouterr().err
    assert main(["costs", "--target", str(tiny_dir), "--backends", "nope"]) == 2


def test_arithmetic_floor_times_every_product_a_pass_runs(pair, tiny_dir, capsys):
    """``verispec costs --arithmetic-floor``'s measurement: the products of a pass of w tokens are every weight the
    float model multiplies by (joined or not, the same rows in all), each at w rows; timed with their weights in
    cache, by block type."""
    from verispec.backends.block_floor import pass_products, products_in_cache
    from verispec.cli import main

    float_model, model = pair
    linear = [m for m in float_model.model.modules() if isinstance(m, torch.nn.Linear)]
    for width in (1, 3):
        products = pass_products(model, width, context=4)
        assert {rows for _, rows in products} == {width}
        assert sum(m.N * m.K for m, _ in products) == sum(m.in_features * m.out_features for m in linear)
    floor = products_in_cache(model, (1, 3), context=4, seconds=0.001, rounds=1)
    assert set(floor) == {1, 3}
    for parts in floor.values():
        kinds = {k: v for k, v in parts.items() if k != "all"}
        assert set(kinds) == set(model.swapped.kinds) and all(v > 0 for v in kinds.values())
        assert parts["all"] == pytest.approx(sum(kinds.values()))
    assert main(["costs", "--target", str(tiny_dir), "--backends", "transformers", "--arithmetic-floor"]) == 2
    assert "--arithmetic-floor times the products of blocks; add blocks to --backends" in capsys.readouterr().err


def k_model(seed: int = 8, kinds=blockmm.K_TYPES):
    """A one-layer Llama whose matrices are random blocks of ``kinds`` in turn (K types by default: gguf quantizes
    none; their columns a multiple of 256), the float model holding their values, and the blocks as a file's rows
    would be found."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    from transformers import LlamaConfig, LlamaForCausalLM
    from test_blockmm import random_blocks

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    rows = GGUFRows(path=None)
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    for i, (name, linear) in enumerate(linears):
        kind = kinds[i % len(kinds)]
        raw = random_blocks(kind, *linear.weight.shape, seed=seed + i).numpy()
        values = dequantize(raw, GGMLQuantizationType[kind]).reshape(linear.weight.shape)
        with torch.no_grad():
            linear.weight.copy_(torch.from_numpy(values))
        rows.add(name, kind, np.ascontiguousarray(raw), values)
    return loaded(model), rows


def test_the_kernels_paths_are_timed_once_and_later_loads_restore_them(tmp_path, monkeypatch, caplog):
    """The paths ``choose_paths`` picks at a load are stored with the CPU, kernel, threads and the model's matrices: a
    second load of the same matrices restores them (another model's choice changed them in between) without timing;
    a record this CPU cannot follow is ignored and the paths timed again; other matrices are another record."""
    import json
    import logging

    from test_blockmm import kernel_settings_restored

    monkeypatch.setenv("VERISPEC_COST_CACHE", str(tmp_path))
    timed, choose = [], blockmm.choose_paths
    monkeypatch.setattr(blockmm, "choose_paths", lambda matrices, *a, **k: timed.append(1) or choose(matrices, *a, **k))

    def load(kinds=("Q8_0", "Q4_K")):
        return on_blocks(*k_model(kinds=kinds))

    with kernel_settings_restored():
        first = load()
        chosen = blockmm.path_settings(first.swapped.kinds)
        records = list(tmp_path.glob("block-paths-*.json"))
        assert len(timed) == 1 and len(records) == 1
        blockmm.set_prefetch(0 if chosen["prefetch"] else blockmm.PREFETCH)
        blockmm.set_one_row_limit("Q8_0", 0 if chosen["one_row"]["Q8_0"] else 16)
        second = load()
        assert len(timed) == 1 and blockmm.path_settings(second.swapped.kinds) == chosen
        with torch.inference_mode():
            assert torch.equal(first.forward(first.new_kv(), [1, 5, 9]).logits,
                               second.forward(second.new_kv(), [1, 5, 9]).logits)
        record = json.loads(records[0].read_text())
        record["value"]["wide"] = "avx1024"
        records[0].write_text(json.dumps(record))
        with caplog.at_level(logging.WARNING, logger="verispec.backends.blocks"):
            load()
        assert len(timed) == 2 and "timing them again" in caplog.text and "avx1024" in caplog.text
        load(kinds=("Q4_0",))
        assert len(timed) == 3 and len(list(tmp_path.glob("block-paths-*.json"))) == 2


@torch.inference_mode()
@pytest.mark.parametrize("types", [blockmm.K_TYPES, ("Q4_K",), ("Q4_0", "Q4_1", "Q5_0", "Q8_0")])
def test_matrices_laid_out_16_rows_at_a_time_keep_every_bit(types, monkeypatch):
    """The load lays out the types ``choose_paths`` keeps 16 rows at a time (here forced: none, then all): the joined
    products read that layout too, a wide pass and one-token steps give the bits of the file's layout, and ``weight``
    (read by EAGLE / Medusa heads) the file's values (Q8_0's and Q5_0's bits changed by the layout changed back)."""
    if not all(blockmm.can_pack16(kind, 16) for kind in types):
        pytest.skip(f"this CPU (best set {blockmm.best_isa()}) does not read {', '.join(types)} in the 16-row layout")
    if types == ("Q4_K",) and blockmm.can_pack16("Q6_K", 16):
        pytest.skip("Q4_K is laid out with the other K types on this CPU (the case before)")
    got = []
    monkeypatch.setenv("VERISPEC_COST_CACHE", "0")  # each load times its paths (a stored choice would skip the patch)
    for kinds in ((), types):
        monkeypatch.setattr(blockmm, "_choose_pack16", lambda matrices, rounds, kinds=kinds:
                            (blockmm.set_pack16_kinds(kinds), ({}, ()))[1])
        float_model, rows = k_model(kinds=types)
        model = on_blocks(float_model, rows)
        linears = [m for m in model.model.modules() if isinstance(m, BlockLinear)]
        assert {m.kind.name for m in linears} == set(types)
        assert all(m.packed == bool(kinds) and ("16-row layout" in repr(m)) == bool(kinds) for m in linears)
        lean = model.model.model.layers[0].__dict__["forward"]
        joined = [matrix for products in (lean.qkv, lean.gate_up) for matrix, _, _ in products.runs]
        assert all(matrix.packed == bool(kinds) for matrix in joined)
        kv = model.new_kv()
        wide = model.forward(kv, [1, 5, 9, 3, 7, 11]).logits
        kv.truncate(2)
        steps = torch.stack([model.forward(kv, [t]).logits[-1] for t in (9, 3, 7, 11)])
        assert torch.equal(wide[2:], steps)  # rows invariant to the pass's width in either layout
        got.append((wide, [m.weight for m in linears]))
    assert torch.isfinite(got[0][0]).all() and torch.equal(got[0][0], got[1][0])
    assert all(torch.equal(a, b) for a, b in zip(got[0][1], got[1][1]))


@torch.inference_mode()
def test_a_layout_changed_in_place_after_the_load_reaches_the_native_layer_front(monkeypatch):
    """Matrices laid out back to the file's layout in place after the load (as experiments/pack16_ab.py does): the
    native layer front reads each product's layout again, so its passes keep their bits."""
    from verispec.backends.blocks import _matrices

    types = tuple(kind for kind in blockmm.K_TYPES if blockmm.can_pack16(kind, 16)) or ("Q4_0", "Q4_1", "Q5_0", "Q8_0")
    if not blockmm.can_pack16(types[0], 16):
        pytest.skip(f"this CPU (best set {blockmm.best_isa()}) reads no type in the 16-row layout")
    monkeypatch.setenv("VERISPEC_COST_CACHE", "0")  # the load times its paths (a stored choice would skip the patch)
    monkeypatch.setattr(blockmm, "_choose_pack16",
                        lambda matrices, rounds: (blockmm.set_pack16_kinds(types), ({}, ()))[1])
    float_model, rows = k_model(kinds=types)
    model = on_blocks(float_model, rows)
    assert all(layer.__dict__["forward"].front is not None for layer in model.model.model.layers)
    before = model.forward(model.new_kv(), [1, 5, 9, 3]).logits
    for m in model.model.modules():
        if isinstance(m, BlockLinear) and m.packed:
            blockmm.pack16(m.blocks, m.kind, unpack=True)
            m.packed = False
    for matrix in _matrices(model.model):
        matrix.packed = False
    assert torch.equal(model.forward(model.new_kv(), [1, 5, 9, 3]).logits, before)
