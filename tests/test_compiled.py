"""The compiled one-token step (verispec.backends.hf.compiled), the fixed-buffer cache it runs on, and the compile
cache on disk (verispec.backends.torch_cpu.compile_store).

The cache is checked eagerly (no compiler) against a fresh forward over the whole sequence, through rollbacks,
trees and growth. The step is compiled once on a tiny model (AOTInductor, ~15-30 s) and must give greedy output
identical to the eager path, plain and speculative; a second model with the same weights loads it from disk, a model
with other weights of the same shapes must not, a damaged file is removed; a missing compiler leaves decoding eager
and working. A server's background compile (``--compile auto``) is run for real on a saved tiny model."""

import json
import logging
from pathlib import Path

import pytest
import torch
from tiny import loaded, make_model

from verispec.backends import COMPILE_ENV, compile_mode, default_compile_mode
from verispec.backends.torch_cpu import compile_store
from verispec.backends.hf import compiled as compiled_module
from verispec.backends.hf.cache import TorchKV
from verispec.backends.hf.compiled import VERIFY_WIDTHS, FixedKV, unpacked_copy
from verispec.drafters.ngram import NgramDrafter
from verispec.controller import shared_cost_curve
from verispec.engine import SpeculativeDecoder
from verispec.errors import InvalidRequest
from verispec.backends.torch_cpu.packing import PackedLinear, pack_linear_layers


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


@pytest.mark.parametrize("kind", ["fixed", "growing"])
def test_a_trees_accepted_path_kept_in_the_cache_reads_as_if_fed_in_order(kind, small_growth):
    """After a tree pass the engine keeps the accepted path's keys (``keep``) instead of feeding it again: the next
    pass must see exactly the context a fresh forward over the committed tokens sees."""
    target = loaded(make_model(seed=4))
    kv = FixedKV(capacity=8) if kind == "fixed" else TorchKV()
    prompt = [5, 9, 3, 5]
    nodes, parents = [10, 11, 12, 13, 14], [-1, -1, 1, 2, 0]  # the path 11 -> 12 -> 13 sits after a sibling
    with torch.inference_mode():
        target.forward(kv, prompt[:-1], last_only=True)
        target.forward(kv, prompt[-1:] + nodes, parents=parents)
        kv.keep(len(prompt), [len(prompt) + i for i in (1, 2, 3)])
        assert len(kv) == len(prompt) + 3
        out = target.forward(kv, [20, 21]).logits
        kv.keep(len(kv), [])  # nothing accepted: nothing moves
    torch.testing.assert_close(out, _fresh(target.model, prompt + [11, 12, 13, 20, 21])[-2:], atol=1e-5, rtol=1e-5)
    assert len(kv) == len(prompt) + 5


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
    # the same weights run compiled and eagerly cost differently: each way has a cost curve of its own
    assert fast.cost_state == (True, True) and eager.cost_state == (False, False)
    assert shared_cost_curve(fast) is not shared_cost_curve(eager)
    assert shared_cost_curve(fast) is shared_cost_curve(fast)
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


def test_verify_passes_run_the_compiled_verify_program_and_match_a_fresh_forward(store, monkeypatch):
    from test_eagle import LAYERS

    model, fast = store
    verify = fast.verify
    assert verify is not None and verify.widths == VERIFY_WIDTHS and verify.path != fast.step.path
    assert "verify passes and token trees of 2-12 tokens" in fast.kernel
    prompt = [5, 9, 3, 5, 9, 4, 7, 2, 8, 6, 1, 3, 5, 9, 3, 5, 9, 4, 7, 2, 8]
    fresh = _fresh(model, prompt)
    calls = []

    class Counted:  # the verify program, counting the widths it ran
        widths = verify.widths

        def __call__(self, kv, tokens, parents=None):
            calls.append(len(tokens))
            return verify(kv, tokens, parents)

    monkeypatch.setattr(fast, "verify", Counted())
    kv = fast.new_kv()
    with torch.inference_mode():
        fast.forward(kv, prompt[:3], last_only=True)  # the first pass lays out the buffers: eager
        wide = fast.forward(kv, prompt[3:8], feature_layers=LAYERS)  # 5 tokens: compiled
        kv.truncate(5)  # a rollback: the next pass writes where the rejected tokens were
        last = fast.forward(kv, prompt[5:7], last_only=True)  # 2 tokens, the last row only
        widest = fast.forward(kv, prompt[7:19])  # 12 tokens: compiled
        ref = loaded(model).forward(loaded(model).new_kv(), prompt, feature_layers=LAYERS)
    assert calls == [5, 2, 12]
    torch.testing.assert_close(wide.logits, fresh[3:8], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(wide.hidden, ref.hidden[3:8], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(last.logits, fresh[6:7], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(widest.logits, fresh[7:19], atol=1e-5, rtol=1e-5)
    with torch.inference_mode():
        kv.truncate(2)
        eager_wide = fast.forward(kv, prompt[2:15])  # 13 tokens: wider than the program, eager
    assert calls == [5, 2, 12]
    torch.testing.assert_close(eager_wide.logits, fresh[2:15], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="cannot run a pass of 13 tokens"):
        verify(fast.new_kv(), prompt[:13])
    expected = _greedy(loaded(model), None, prompt[:6])
    calls.clear()
    assert _greedy(fast, NgramDrafter(), prompt[:6]) == expected  # compiled steps and compiled verify passes
    assert any(width > 1 for width in calls), "no verify pass ran compiled"


def test_token_trees_run_the_compiled_verify_program_and_match_each_branch_alone(store, monkeypatch):
    from test_eagle import LAYERS

    model, fast = store
    verify = fast.verify
    calls = []

    class Counted:  # the verify program, counting what it ran
        widths = verify.widths

        def __call__(self, kv, tokens, parents=None):
            calls.append((len(tokens), parents))
            return verify(kv, tokens, parents)

    monkeypatch.setattr(fast, "verify", Counted())
    prompt = [5, 9, 3, 5, 9, 4, 7, 2, 8, 6]
    nodes, parents = [10, 11, 12, 13, 14, 15], [-1, 0, 1, -1, 3, 0]  # two roots, the first forks after one node
    paths = [[10], [10, 11], [10, 11, 12], [13], [13, 14], [10, 15]]
    kv = FixedKV(capacity=8)
    reference = loaded(model)
    with torch.inference_mode():
        fast.forward(kv, prompt[:-2], last_only=True)  # eager: lays out the buffers (8 positions)
        tree = fast.forward(kv, prompt[-2:] + nodes, parents=parents, feature_layers=LAYERS)  # grows them to 16
        kv.truncate(len(prompt))  # the nodes dropped, as the engine does after a tree step
        after = fast.forward(kv, [20, 21]).logits  # written over the nodes' columns
        hidden = [reference.forward(reference.new_kv(), prompt + path, feature_layers=LAYERS).hidden[-1]
                  for path in paths]
    assert calls == [(8, parents), (2, None)] and kv.capacity == 16
    torch.testing.assert_close(tree.logits[:2], _fresh(model, prompt)[-2:], atol=1e-5, rtol=1e-5)
    for i, path in enumerate(paths):
        torch.testing.assert_close(tree.logits[2 + i], _fresh(model, prompt + path)[-1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(tree.hidden[2 + i], hidden[i], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(after, _fresh(model, prompt + [20, 21])[-2:], atol=1e-5, rtol=1e-5)


def test_verify_passes_stay_eager_when_switched_off(store, monkeypatch):
    model, _ = store
    monkeypatch.setenv("VERISPEC_COMPILED_VERIFY", "0")
    target = loaded(model)
    assert target.compile_step(cached_only=True) is True and target.step is not None
    target.wait_compiled()
    assert target.verify is None
    assert "verify passes" not in target.kernel
    assert _greedy(target, NgramDrafter(), [5, 9, 3, 5, 9, 4], n=12) == _greedy(loaded(model), None,
                                                                                 [5, 9, 3, 5, 9, 4], n=12)


def test_the_verify_program_is_left_out_where_memory_is_short_unless_asked_for(store, monkeypatch, caplog):
    import verispec.backends.hf.model as hf

    model, _ = store
    need, _ = hf.verify_memory(model)
    monkeypatch.setattr(hf, "_available_memory", lambda: need)  # it would take more than half of what is left
    short = loaded(model)
    with caplog.at_level(logging.INFO, logger="verispec.backends.hf"):
        assert short.compile_step(cached_only=True) is True
    short.wait_compiled()
    assert short.step is not None and short.verify is None and "verify passes stay eager" in caplog.text
    monkeypatch.setenv("VERISPEC_COMPILED_VERIFY", "1")
    forced = loaded(model)
    assert forced.compile_step(cached_only=True) is True
    forced.wait_compiled()
    assert forced.verify is not None and forced.verify.loaded
    monkeypatch.setattr(hf, "_available_memory", lambda: 3 * need)  # room enough: used without being asked
    monkeypatch.delenv("VERISPEC_COMPILED_VERIFY")
    roomy = loaded(model)
    assert roomy.compile_step(cached_only=True) is True
    roomy.wait_compiled()
    assert roomy.verify is not None


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
        widths = step.widths

        def __call__(self, kv, tokens, parents=None):
            calls.append(tokens)
            return step(kv, tokens, parents)

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
    again.wait_compiled()  # the stored verify program loads in the background
    assert _greedy(again, None, [5, 9, 3], n=12) == _greedy(loaded(model), None, [5, 9, 3], n=12)
    other = make_model(seed=5, scale=0.5)
    with torch.no_grad():
        other.model.layers[1].mlp.down_proj.weight.mul_(1.5)  # same shapes, other weights: torch's own cache
    assert loaded(other).compile_step(cached_only=True) is False  # would hand it the first model's kernels
    record = json.loads(again.step.path.with_suffix(".json").read_text())
    assert record["key"]["width"] == 1 and record["bytes"] == again.step.path.stat().st_size
    assert again.verify is not None and again.verify.loaded is True  # its verify program too, under its own key
    verify_record = json.loads(again.verify.path.with_suffix(".json").read_text())
    assert verify_record["key"]["width"] == "2-12" and verify_record["key"]["weights"] == record["key"]["weights"]
    assert sorted(r["path"] for r in compile_store.records()) == sorted([str(again.step.path), str(again.verify.path)])


def test_every_key_keeps_its_library_and_the_store_drops_the_least_recently_used(tmp_path, monkeypatch, capsys):
    """Two environments sharing a cache keep each other's libraries (no rebuilding each other's forever); the size
    cap removes the least recently used first, never the one just built; ``verispec cache prune`` on demand."""
    import os
    import time

    from verispec.cli import main

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    folder = compile_store.folder()
    folder.mkdir(parents=True)

    def stored(name, weights, age, size=1000):
        (folder / f"{name}.so").write_bytes(b"x" * size)
        meta = folder / f"{name}.json"
        meta.write_text(json.dumps({"built": name, "bytes": size, "key": {"weights": weights, "width": 1}}))
        os.utime(meta, (time.time() - age, time.time() - age))
        return folder / f"{name}.so"

    torch_a = stored("step-a", "w1", age=30)  # the same weights, built under two keys (two torch versions)
    torch_b = stored("step-b", "w1", age=20)
    other = stored("step-c", "w2", age=10)
    assert compile_store.prune(10_000) == []  # under the cap: every key keeps its own
    compile_store.mark_used(torch_a)  # loaded just now: the most recently used
    assert compile_store.prune(2_000, keep=(other,)) == [torch_b]
    assert sorted(Path(r["path"]).name for r in compile_store.records()) == ["step-a.so", "step-c.so"]
    assert main(["cache", "prune", "--max-gb", "0"]) == 0
    assert "removed 2 compiled program(s); 0 left" in capsys.readouterr().out
    monkeypatch.setenv(compile_store.CAP_ENV, "lots")
    with pytest.raises(ValueError, match="GB"):
        compile_store.cap_bytes()


TWO_BUILDS = """
import sys, torch
from pathlib import Path
from verispec.backends.torch_cpu import compile_store
torch.manual_seed(0)
layer = torch.nn.Linear(8, 4).eval()
exported = torch.export.export(layer, (torch.ones(1, 8),))
path = Path(sys.argv[1])
compile_store.save(exported, path, {"weights": "w", "width": 1}, "linear")
print(float(compile_store.load(path)(torch.ones(1, 8)).sum()))
"""


def test_two_processes_compiling_into_one_cache_at_once_both_succeed(tmp_path, monkeypatch):
    import subprocess
    import sys

    env = {**__import__("os").environ, "VERISPEC_CACHE": str(tmp_path), "VERISPEC_COMPILE_AUTOTUNE": "0",
           "OMP_NUM_THREADS": "1"}
    path = tmp_path / "compiled" / "step-shared.so"
    runs = [subprocess.Popen([sys.executable, "-c", TWO_BUILDS, str(path)], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [run.communicate(timeout=600) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], [err[-2000:] for _, err in outs]
    torch.manual_seed(0)
    with torch.no_grad():
        expected = float(torch.nn.Linear(8, 4)(torch.ones(1, 8)).sum())
    assert [float(out.strip().splitlines()[-1]) for out, _ in outs] == pytest.approx([expected, expected], abs=1e-5)
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    assert [Path(r["path"]).name for r in compile_store.records()] == ["step-shared.so"]
    assert not list((tmp_path / "compiled").glob("*partial*"))


def test_the_store_format_is_part_of_the_key(monkeypatch):
    model = make_model(seed=2)
    key = compile_store.package_key(model, 1, "src")
    assert key["format"] == compile_store.FORMAT
    monkeypatch.setattr(compile_store, "FORMAT", compile_store.FORMAT + 1)
    assert compile_store.package_path(compile_store.package_key(model, 1, "src")) != compile_store.package_path(key)


def test_autotuning_is_on_by_default_part_of_the_key_and_a_bad_setting_is_refused(monkeypatch):
    model = make_model(seed=2)
    monkeypatch.delenv(compile_store.AUTOTUNE_ENV, raising=False)
    assert compile_store.options() == {**compile_store.OPTIONS, "freezing": True, "max_autotune": True}
    tuned = compile_store.package_path(compile_store.package_key(model, 1, "src"))
    monkeypatch.setenv(compile_store.AUTOTUNE_ENV, "0")
    assert compile_store.options()["max_autotune"] is False
    assert compile_store.package_path(compile_store.package_key(model, 1, "src")) != tuned  # never mistaken
    monkeypatch.setenv(compile_store.AUTOTUNE_ENV, "maybe")
    with pytest.raises(ValueError, match="VERISPEC_COMPILE_AUTOTUNE='maybe'.*use 1"):
        compile_store.options()


def test_a_damaged_package_is_removed_and_never_run(store, caplog, tmp_path, monkeypatch):
    model, fast = store
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))
    damaged = compile_store.folder() / fast.step.path.name
    damaged.parent.mkdir(parents=True)
    damaged.write_bytes(b"not a package")
    target = loaded(model)
    with caplog.at_level(logging.WARNING, logger="verispec.backends.torch_cpu.compile_store"):
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
    with pytest.raises(InvalidRequest, match=r"compiled \(--compile\) takes auto, on, off, not 'sometimes'"):
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
    monkeypatch.setenv(compile_store.AUTOTUNE_ENV, "0")  # the child builds faster (its kernels are not under test)
    options = ServeOptions(target=str(tiny_dir), drafter="ngram", max_batch=1, backend_options={"compile": "auto"})
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
    batched = build_server_config(ServeOptions(target=str(tiny_dir), drafter="ngram", backend_options={"compile": "auto"}))
    assert batched.compile_job is None and batched.target.step is None  # batched passes never use the step
    failing = BackgroundCompile(loaded(make_model(seed=8)), "no-such-model")
    failing.start()
    failing.join(timeout=300)
    assert failing.state == "failed"


def test_the_compiled_eagle_head_steps_like_the_torch_head_and_is_stored_under_its_weights(store):
    """The head's draft step as an AOTInductor program (``verispec.eagle.compiled``): g, logits (context-vocabulary
    rows included) and the cached keys and values equal the torch head's step after step, whether the program or the
    torch head (a first step, or more pairs than the program takes) ran it; stored under the head's weights, so
    the same weights load it and other weights never do."""
    from test_eagle import random_head

    from verispec.eagle import compiled as compiled_head
    from verispec.eagle.head import HeadCache

    _, fast = store
    head = random_head(fast, 20)
    built = compiled_head.CompiledHeadSteps.load_or_build(head, fast.embedding_model, "tiny")
    assert built.loaded is False and built.path.exists() and built.path.parent == compile_store.folder()
    extra = fast.embedding_model.get_output_embeddings().weight.detach()[:3]
    hidden = head.config.hidden_size
    caches = HeadCache(), HeadCache()
    feeds = [(torch.tensor([3, 4, 5, 6]), torch.randn(4, hidden)),  # first step: the torch head
             (torch.tensor([7]), torch.randn(1, hidden)), (torch.tensor([8, 9, 10]), torch.randn(3, hidden)),
             (torch.arange(1, compiled_head.MAX_ROWS + 2) % 30, torch.randn(compiled_head.MAX_ROWS + 1, hidden)),
             (torch.tensor([11]), torch.randn(1, hidden))]
    calls = []
    runner = built._runner
    built._runner = lambda *args: calls.append(args[0].shape[0]) or runner(*args)
    with torch.inference_mode():
        for tokens, features in feeds:
            g_t, logits_t = head.step_logits(tokens, features, caches[0], extra)
            g_c, logits_c = built.step_logits(tokens, features, caches[1], extra)
            assert logits_c.shape == logits_t.shape == (1, 20 + 3)
            torch.testing.assert_close(g_c, g_t, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(logits_c, logits_t, atol=1e-4, rtol=1e-4)
    assert calls == [1, 3, 1]  # the first step and the 33 pairs ran the torch head
    assert len(caches[1]) == len(caches[0]) == 4 + 1 + 3 + (compiled_head.MAX_ROWS + 1) + 1
    torch.testing.assert_close(caches[1].k, caches[0].k, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(caches[1].v, caches[0].v, atol=1e-4, rtol=1e-4)
    again = compiled_head.CompiledHeadSteps.load_or_build(random_head(fast, 20), fast.embedding_model,
                                                          cached_only=True)
    assert again is not None and again.loaded is True and again.path == built.path
    assert compiled_head.CompiledHeadSteps.load_or_build(random_head(fast, 20, seed=1), fast.embedding_model,
                                                         cached_only=True) is None
    with pytest.raises(InvalidRequest, match="float32"):
        compiled_head.CompiledHeadSteps.load_or_build(random_head(fast, 20).to(torch.bfloat16), fast.embedding_model)


def test_eagle_drafts_through_the_compiled_head_where_the_target_runs_compiled_with_plain_greedy_output(store):
    """``engine=auto`` takes the stored head program where the target runs compiled, the torch head where it runs
    eagerly; ``engine=compiled`` builds one; greedy output is plain decoding's either way."""
    from test_eagle import random_head

    from verispec import EagleDrafter

    model, fast = store
    eager = loaded(model)
    prompt = [5, 9, 3, 5, 9, 4, 7]
    expected = _greedy(eager, None, prompt)
    assert EagleDrafter(eager, random_head(eager, 20)).engine == "torch"
    assert EagleDrafter(fast, random_head(fast, 20, seed=3)).engine == "torch"  # nothing stored for these weights
    # seed 0's program: built here, or stored by the test before (one compile for the two tests)
    drafter = EagleDrafter(fast, random_head(fast, 20), engine="compiled")
    assert drafter.engine == "compiled"
    auto = EagleDrafter(fast, random_head(fast, 20))
    assert auto.engine == "compiled" and auto.steps.loaded is True
    calls = []
    runner = auto.steps._runner
    auto.steps._runner = lambda *args: calls.append(1) or runner(*args)
    assert _greedy(fast, auto, prompt) == expected
    assert calls, "no draft step ran the compiled head"
    assert _greedy(fast, drafter, prompt) == expected
    assert _greedy(eager, EagleDrafter(eager, random_head(eager, 20), engine="compiled"), prompt) == expected
    with pytest.raises(InvalidRequest, match="float32"):
        EagleDrafter(fast, random_head(fast, 20), engine="compiled", precision="bfloat16")
    # a server compiling its target in the background: the drafter built while the target ran eagerly takes the
    # stored head program at the first request after the target's own step is there
    switching = loaded(model)
    waiting = EagleDrafter(switching, random_head(switching, 20))
    assert waiting.engine == "torch"
    assert _greedy(switching, waiting, prompt) == expected and waiting.engine == "torch"
    assert switching.compile_step(cached_only=True) is True  # what BackgroundCompile does once the child is done
    assert _greedy(switching, waiting, prompt) == expected and waiting.engine == "compiled"
