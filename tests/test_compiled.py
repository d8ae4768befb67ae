"""The compiled one-token step (verispec.backends.hf.compiled), the fixed-buffer cache it runs on, and the compile
cache on disk (verispec.backends.hf.compile_store).

The cache is checked eagerly (no compiler) against a fresh forward over the whole sequence, through rollbacks,
trees and growth. The step is compiled once on a tiny model (AOTInductor, ~15-30 s) and must give greedy output
identical to the eager path, plain and speculative; a second model with the same weights loads it from disk, a model
with other weights of the same shapes must not, a damaged file is removed; a missing compiler leaves decoding eager
and working. A server's background compile (``--compile auto``) is run for real on a saved tiny model."""

import json
import logging

import pytest
import torch
from tiny import loaded, make_model

from verispec.backends import COMPILE_ENV, compile_mode, default_compile_mode
from verispec.backends.hf import compile_store
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


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A compile cache of this module's own, with one step compiled into it (the tiny model of seed 5)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("VERISPEC_CACHE", str(tmp_path_factory.mktemp("verispec-cache")))
    mp.setattr(compiled_module, "GROWTH", 8)  # grow every 8 positions: many resizes in a short test
    model = make_model(seed=5, scale=0.5)
    pack_linear_layers(model)
    fast = loaded(model)
    assert fast.compile_step() is True
    yield model, fast
    mp.undo()


def test_compiled_step_gives_the_eager_greedy_output_plain_and_speculative(store):
    model, fast = store
    eager = loaded(model)
    assert fast.step.loaded is False and fast.step.seconds > 0 and "compiled (AOTInductor)" in fast.kernel
    assert fast.step.path.exists() and fast.step.path.parent == compile_store.folder()
    assert isinstance(fast.new_kv(), FixedKV) and isinstance(eager.new_kv(), TorchKV)
    prompt = [5, 9, 3, 5, 9, 4]
    expected = _greedy(eager, None, prompt)
    assert _greedy(fast, None, prompt) == expected  # every step compiled, the buffers grown 5 times
    assert _greedy(fast, NgramDrafter(), prompt) == expected  # compiled steps and eager verify passes mixed
    kv = fast.new_kv()
    with torch.inference_mode():
        fast.forward(kv, prompt[:-1], last_only=True)
        out = fast.forward(kv, prompt[-1:]).logits
        assert all(int(layer.cumulative_length) == len(prompt) for layer in kv.cache.layers)
        kv.truncate(3)  # a rollback after a compiled step: the next eager pass writes where the step wrote
        again = fast.forward(kv, prompt[3:]).logits
    torch.testing.assert_close(out, _fresh(model, prompt)[-1:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(again, _fresh(model, prompt)[3:], atol=1e-5, rtol=1e-5)


def test_the_compiled_step_gives_hidden_states_and_eagle_keeps_plain_greedy_output(store):
    from test_eagle import LAYERS, random_head

    from verispec import EagleDrafter

    model, fast = store
    eager = loaded(model)
    prompt = [5, 9, 3, 5, 9, 4, 7]
    kv = fast.new_kv()
    with torch.inference_mode():
        fast.forward(kv, prompt[:-1], last_only=True)
        out = fast.forward(kv, prompt[-1:], feature_layers=LAYERS)  # the compiled step, with features
        ref = eager.forward(eager.new_kv(), prompt, feature_layers=LAYERS)
    assert out.hidden.shape == (1, len(LAYERS), model.config.hidden_size)
    torch.testing.assert_close(out.hidden[0], ref.hidden[-1], atol=1e-5, rtol=1e-5)
    expected = _greedy(eager, None, prompt)
    head = random_head(fast, 20)
    step, calls = fast.step, []

    class Counted:  # the step, counting its calls
        def __call__(self, kv, token):
            calls.append(token)
            return step(kv, token)

    fast.step = Counted()
    try:  # the controller's k = 0 steps run the compiled step, and the head drafts from the features it returns
        decoder = SpeculativeDecoder(fast, EagleDrafter(fast, head), k=3, reuse_prefix=False)
        assert decoder.generate(prompt, max_new_tokens=40).token_ids == expected
        assert calls, "no one-token step ran compiled"
        fixed = SpeculativeDecoder(fast, EagleDrafter(fast, head), k=1, k_policy="fixed", reuse_prefix=False)
        assert fixed.generate(prompt, max_new_tokens=40).token_ids == expected
    finally:
        fast.step = step


def test_the_same_weights_load_the_stored_step_and_other_weights_never_do(store, caplog):
    model, _ = store
    again = loaded(model)  # another model object, the same weights: the step comes from disk
    assert again.compile_step(cached_only=True) is True and again.step.loaded is True
    assert _greedy(again, None, [5, 9, 3], n=12) == _greedy(loaded(model), None, [5, 9, 3], n=12)
    other = make_model(seed=5, scale=0.5)
    with torch.no_grad():
        other.model.layers[1].mlp.down_proj.weight.mul_(1.5)  # same shapes, other weights: torch's own cache
    assert loaded(other).compile_step(cached_only=True) is False  # would hand it the first model's kernels
    record = json.loads(again.step.path.with_suffix(".json").read_text())
    assert record["key"]["width"] == 1 and record["bytes"] == again.step.path.stat().st_size
    assert [r["path"] for r in compile_store.records()] == [str(again.step.path)]


def test_a_damaged_package_is_removed_and_never_run(store, caplog, tmp_path, monkeypatch):
    model, fast = store
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    damaged = compile_store.folder() / fast.step.path.name
    damaged.parent.mkdir(parents=True)
    damaged.write_bytes(b"not a package")
    target = loaded(model)
    with caplog.at_level(logging.WARNING, logger="verispec.backends.hf.compile_store"):
        assert target.compile_step(cached_only=True) is False
    assert "did not load" in caplog.text and not damaged.exists()
    assert target.step is None and len(_greedy(target, None, [5, 9, 3], n=5)) == 5


def test_a_missing_compiler_leaves_decoding_eager(monkeypatch, caplog, tmp_path):
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "")
    monkeypatch.setattr(compile_store.shutil, "which", lambda name: None)
    target = loaded(make_model(seed=6))
    with caplog.at_level(logging.WARNING, logger="verispec.backends.hf"):
        assert target.compile_step() is False
    assert "decoding stays eager" in caplog.text and "no C++ compiler found" in caplog.text and "g++" in caplog.text
    assert target.step is None and isinstance(target.new_kv(), TorchKV)
    assert len(_greedy(target, None, [5, 9, 3], n=5)) == 5
    assert not compile_store.folder().exists() or not any(compile_store.folder().iterdir())


def test_compile_is_refused_where_it_was_not_measured():
    target = loaded(make_model(seed=7).to(torch.bfloat16))
    target.dtype = torch.bfloat16
    with pytest.raises(InvalidRequest, match="float32 on CPU"):
        target.compile_step()
    from verispec import load_model

    with pytest.raises(InvalidRequest, match="--compile is for float32"):  # refused before anything loads
        load_model("no-such-model", dtype="bfloat16", compiled=True)
    with pytest.raises(InvalidRequest, match="transformers backend"):
        load_model("smollm2-135m", backend="llamacpp", compiled="on")
    with pytest.raises(InvalidRequest, match="compile takes auto, on, off"):
        load_model("smollm2-135m", compiled="sometimes")


def test_compile_modes_and_the_command_line_default(monkeypatch):
    assert [compile_mode(v) for v in (True, False, "auto", "on", "off")] == ["on", "off", "auto", "on", "off"]
    monkeypatch.delenv(COMPILE_ENV, raising=False)
    assert default_compile_mode() == "auto"
    monkeypatch.setenv(COMPILE_ENV, "OFF")
    assert default_compile_mode() == "off"
    monkeypatch.setenv(COMPILE_ENV, "fast")
    with pytest.raises(InvalidRequest, match="got 'fast'"):
        default_compile_mode()
    monkeypatch.delenv(COMPILE_ENV)
    from verispec.cli import build_parser

    parse = build_parser().parse_args
    assert parse(["generate", "hi"]).compile == "auto"
    assert parse(["generate", "hi", "--compile"]).compile == "on"  # the flag alone, as before
    assert parse(["generate", "hi", "--compile", "off"]).compile == "off"
    assert parse(["serve", "--compile", "on", "--max-batch", "1"]).compile == "on"


def test_a_server_compiles_in_the_background_switches_and_the_next_starts_compiled(tiny_dir, tmp_path, monkeypatch):
    from verispec.server.compiling import BackgroundCompile
    from verispec.server.config import ServeOptions, build_server_config

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))  # the child process stores its step here too
    options = ServeOptions(target=str(tiny_dir), drafter="ngram", max_batch=1, compile="auto")
    config = build_server_config(options)
    job, target = config.compile_job, config.target
    assert job is not None and job.state == "eager" and target.step is None
    eager_kv = target.new_kv()
    expected = _greedy(target, None, [5, 9, 3, 5], n=20)
    job.start()
    assert job.state == "compiling"
    job.join(timeout=600)
    assert job.state == "compiled" and target.step is not None and target.step.loaded
    assert isinstance(target.new_kv(), FixedKV) and isinstance(eager_kv, TorchKV)  # a running request stays eager
    assert _greedy(target, None, [5, 9, 3, 5], n=20) == expected
    assert _greedy(target, NgramDrafter(), [5, 9, 3, 5], n=20) == expected
    restarted = build_server_config(options)
    assert restarted.compile_job is None and restarted.target.step is not None  # found on disk at start
    batched = build_server_config(ServeOptions(target=str(tiny_dir), drafter="ngram", compile="auto"))
    assert batched.compile_job is None and batched.target.step is None  # batched passes never use the step
    failing = BackgroundCompile(loaded(make_model(seed=8)), "no-such-model")
    failing.start()
    failing.join(timeout=300)
    assert failing.state == "failed"
