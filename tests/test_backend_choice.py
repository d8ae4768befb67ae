"""``--backend auto``: without a stored timing it chooses from each engine's declared cost of the file (scaled by the
timings of the nearest model timed on this CPU) and prepares nothing else; ``measure`` (``verispec models --time``)
times the installed engines that keep the model's own weights once per model and CPU and later choices read that;
options only one backend takes decide it without timing; the command line says what it chose before it runs; on tiny
GGUF files the quick choice is the timed one."""

import json
from pathlib import Path

import pytest

from verispec.backends import choice


def _fake_engines(monkeypatch, tmp_path, timings):
    """Every candidate 'loads' as its own name and times as ``timings`` says; returns the list of timed engines."""
    from verispec.backends import timing

    monkeypatch.setenv("VERISPEC_COST_CACHE", str(tmp_path / "measurements"))
    monkeypatch.setattr(choice, "installed", lambda backend: backend in timings)
    timed = []
    monkeypatch.setattr("verispec.backends.load_model", fake_load)
    monkeypatch.setattr(timing, "time_widths", lambda model: timed.append(model) or timings[model])
    return timed


def fake_load(ref, backend, threads):
    return backend  # the "model" is its engine's name


def test_auto_times_each_installed_engine_once_when_asked_and_remembers(tiny_dir, tmp_path, monkeypatch):
    timings = {"openvino": {"1": 12.0, "2": 12.5, "9": 16.0, "prefill": 0.4},
               "transformers": {"1": 40.0, "2": 55.0, "9": 80.0, "prefill": 0.3}}
    timed = _fake_engines(monkeypatch, tmp_path, timings)
    picked = choice.choose(str(tiny_dir), fake_load, threads=2, measure=True)
    assert (picked.backend, picked.weights) == ("openvino", "as-is") and sorted(timed) == sorted(timings)
    assert "openvino" in picked.reason and "transformers" in picked.reason
    (record,) = (tmp_path / "measurements").glob("backend-auto-*.json")
    assert json.loads(record.read_text())["value"]["choice"] == "openvino"
    again = choice.choose(str(tiny_dir), fake_load, threads=2)
    assert again.backend == "openvino" and "timed on this CPU" in again.reason and len(timed) == 2  # read back
    choice.choose(str(tiny_dir), fake_load, threads=1, measure=True)
    assert len(timed) == 4  # another thread count is another measurement


def test_without_a_timing_auto_estimates_and_prepares_nothing(tmp_path, monkeypatch):
    """A first start loads no engine to choose: each declares its cost of the file's tensor types (OpenVINO runs
    K-quant blocks several times slower a byte, transformers computes in float32), the cheapest is chosen, a tie
    within 10% goes to the preferred engine."""
    monkeypatch.setenv("VERISPEC_COST_CACHE", str(tmp_path / "measurements"))
    monkeypatch.setattr(choice, "installed", lambda backend: backend in ("openvino", "llamacpp", "transformers"))
    monkeypatch.setattr(choice.timing, "time_widths", lambda model: pytest.fail("nothing is timed"))

    def no_load(*args, **kwargs):
        pytest.fail("nothing is prepared to choose")

    k_quants = {"Q4_K": 700_000_000, "Q6_K": 340_000_000, "F32": 1_000_000}
    monkeypatch.setattr(choice, "gguf_type_bytes", lambda ref: k_quants)
    picked = choice.choose("qwen2.5-coder-1.5b", no_load)
    assert picked.backend == "llamacpp" and "not timed" in picked.reason and "models --time" in picked.reason
    monkeypatch.setattr(choice, "gguf_type_bytes", lambda ref: {"Q4_1": 63_000_000, "Q8_0": 28_000_000})
    assert choice.choose("smollm2-135m", no_load).backend == "openvino"  # the same bytes: the preferred engine
    assert not (tmp_path / "measurements").exists()  # an estimate is not stored


# bytes per tensor type in the built-in files (their GGUF headers, ``references.gguf_type_bytes``)
BUILTIN_MIXES = {
    "smollm2-135m": {"Q8_0": 30081024, "F32": 140544, "Q4_1": 66355200},
    "gemma3-270m": {"F32": 223744, "Q8_0": 179824640, "Q5_0": 43591680, "Q4_K": 13271040, "Q6_K": 9676800},
    "qwen2.5-coder-0.5b": {"Q8_0": 146105344, "Q5_0": 266742784, "F32": 286208, "Q6_K": 42900480,
                           "Q4_K": 29417472},
    "qwen2.5-coder-1.5b": {"Q6_K": 354009600, "Q4_K": 756781056, "F32": 579584},
    "f16-matrices.gguf": {"F16": 270000000, "F32": 140544},
}


@pytest.mark.parametrize("avx512", [True, False])
@pytest.mark.parametrize("ref, expected", [("smollm2-135m", "blocks"), ("gemma3-270m", "blocks"),
                                           ("qwen2.5-coder-0.5b", "blocks"), ("qwen2.5-coder-1.5b", "blocks"),
                                           ("f16-matrices.gguf", "openvino")])
def test_the_blocks_kernel_is_the_quick_choice_where_it_multiplies_the_files_blocks(ref, expected, avx512, tmp_path,
                                                                                    monkeypatch):
    """Untimed, the engines are weighed by their declared costs of the file: the kernel's passes of several tokens
    cost less than llama.cpp's and OpenVINO's on the block types it multiplies (on AVX-512 VNNI, where the 32-weight
    types are laid out 16 rows at a time, less still), so every built-in file starts on blocks, as each timed on a
    Zen 4; a file of F16 matrices, which the kernel would hold in float32, does not start on blocks (OpenVINO and
    llama.cpp tie on it: the preferred one) (docs/kernels.md)."""
    from verispec import blockmm

    monkeypatch.setattr(blockmm, "best_isa", lambda: "avx512vnni" if avx512 else "avx2")
    monkeypatch.setenv("VERISPEC_COST_CACHE", str(tmp_path / "measurements"))
    monkeypatch.setattr(choice, "installed",
                        lambda backend: backend in ("blocks", "openvino", "llamacpp", "transformers"))
    monkeypatch.setattr(choice, "gguf_type_bytes", lambda r: BUILTIN_MIXES[Path(r).name])
    if ref.endswith(".gguf"):  # a file of the user's: the engines that run a file's blocks take an existing one
        (tmp_path / ref).write_bytes(b"")
        ref = str(tmp_path / ref)
    picked = choice.choose(ref, lambda *a, **k: pytest.fail("nothing is prepared to choose"))
    assert picked.backend == expected and "not timed" in picked.reason
    assert "blocks" in picked.reason and "llamacpp" in picked.reason


def test_the_estimate_is_scaled_by_the_nearest_model_timed_here(tmp_path, monkeypatch):
    """Timings of a similar file on this CPU turn each engine's declared cost into ms: an engine that the declared
    costs rank first but that ran slower a byte here loses."""
    timings = {"openvino": {"1": 40.0, "prefill": 0.4}, "llamacpp": {"1": 10.0, "prefill": 0.3}}
    _fake_engines(monkeypatch, tmp_path, timings)
    monkeypatch.setattr(choice, "gguf_type_bytes", lambda ref: {"Q4_0": 100_000_000})
    assert choice.choose("smollm2-135m", fake_load, threads=2).backend == "openvino"  # declared: a tie
    choice.choose("smollm2-135m", fake_load, threads=2, measure=True)  # here llama.cpp is 4x faster a byte
    monkeypatch.setattr(choice, "gguf_type_bytes", lambda ref: {"Q4_0": 150_000_000})
    picked = choice.choose("gemma3-270m", lambda *a, **k: pytest.fail("nothing is prepared"), threads=2)
    assert picked.backend == "llamacpp" and "scaled from smollm2-135m" in picked.reason
    from verispec.backends.timing import auto_score

    assert f"llamacpp {1.5 * auto_score(timings['llamacpp']):.1f}" in picked.reason  # the timed file's, 1.5x the bytes


def test_the_quick_choice_is_the_timed_one_on_tiny_gguf_files(tmp_path, monkeypatch):
    """Real engines (llama.cpp and transformers) on two tiny GGUF files: after the first file is timed, the second
    file's quick choice costs at most 10% more a token than the best of its own full timing."""
    from conftest import require_llama_cpp
    from transformers import AutoTokenizer

    from verispec.backends import load_model, timing
    from verispec.backends.references import DEFAULT_MODEL, resolve
    from zoo import zoo_gguf

    require_llama_cpp()
    monkeypatch.setenv("VERISPEC_COST_CACHE", str(tmp_path / "measurements"))
    monkeypatch.setattr(choice, "installed", lambda backend: backend in ("llamacpp", "transformers"))
    tokenizer = AutoTokenizer.from_pretrained(str(resolve(DEFAULT_MODEL)))
    # both files carry this tokenizer: the engines get it as is instead of converting each file's copy (20 s apiece)
    original = AutoTokenizer.from_pretrained
    monkeypatch.setattr(AutoTokenizer, "from_pretrained",
                        lambda *a, **k: tokenizer if k.get("gguf_file") else original(*a, **k))
    first = zoo_gguf("llama", tokenizer, tmp_path / "first", seed=0, max_position_embeddings=512)
    second = zoo_gguf("llama", tokenizer, tmp_path / "second", seed=1, intermediate_size=96,
                      max_position_embeddings=512)  # timing passes run after 256 cached tokens
    from gguf import GGUFReader

    held = {}
    for tensor in GGUFReader(str(second)).tensors:  # the header walk agrees with gguf's own reader
        held[tensor.tensor_type.name] = held.get(tensor.tensor_type.name, 0) + int(tensor.n_bytes)
    assert choice.gguf_type_bytes(str(second)) == held
    choice.choose(str(first), load_model, measure=True)
    quick = choice.choose(str(second), load_model)
    assert "scaled from" in quick.reason
    timed = choice.choose(str(second), load_model, measure=True)
    score = {name: timing.auto_score(ms) for name, ms in timed.timings_ms.items()}
    assert score[quick.backend] <= 1.10 * min(score.values()), (quick.reason, score)


def test_the_faster_engine_wins_whichever_it_is(tiny_dir, tmp_path, monkeypatch):
    timings = {"openvino": {"1": 30.0, "2": 31.0, "prefill": 0.4}, "transformers": {"1": 10.0, "2": 11.0,
                                                                                     "prefill": 0.3}}
    _fake_engines(monkeypatch, tmp_path, timings)
    assert choice.choose(str(tiny_dir), fake_load, threads=2, measure=True).backend == "transformers"


def test_only_engines_that_run_the_model_are_candidates(tiny_dir, monkeypatch):
    monkeypatch.setattr(choice, "installed", lambda backend: True)
    assert choice.candidates(str(tiny_dir)) == ["openvino", "transformers"]  # a folder: no GGUF for llama.cpp
    assert choice.candidates("smollm2-135m") == ["openvino", "llamacpp", "blocks", "transformers"]
    assert choice.candidates("someone/some-model") == ["transformers"]  # a hub id: OpenVINO exports local models
    monkeypatch.setattr(choice, "installed", lambda backend: backend == "transformers")
    picked = choice.choose("smollm2-135m", fake_load)
    assert picked.backend == "transformers" and "not installed: openvino, llamacpp, blocks" in picked.reason


@pytest.mark.parametrize("options, backend", [(dict(dtype="bfloat16"), "transformers"),
                                              (dict(compiled="on"), "transformers"),
                                              (dict(weights="q8_0"), "llamacpp"),
                                              (dict(weights="int4"), "openvino")])
def test_options_only_one_backend_takes_decide_it_without_timing(options, backend, monkeypatch):
    monkeypatch.setattr(choice.timing, "time_widths", lambda model: pytest.fail("nothing is timed"))
    assert choice.choose("smollm2-135m", fake_load, **options).backend == backend


def test_the_command_line_resolves_auto_before_it_runs_and_says_so(tiny_dir, tmp_path, monkeypatch, capsys):
    from verispec.cli import build_parser, resolve_auto_backend

    _fake_engines(monkeypatch, tmp_path, {"openvino": {"1": 12.0, "prefill": 0.4},
                                          "transformers": {"1": 40.0, "prefill": 0.3}})
    monkeypatch.setenv("VERISPEC_BACKEND", "auto")
    args = build_parser().parse_args(["generate", "hi", "--target", str(tiny_dir)])
    assert args.backend == "auto"
    resolve_auto_backend(args)
    assert args.backend == "openvino"
    assert "--backend auto chose openvino (as-is weights)" in capsys.readouterr().err


def test_models_time_times_every_engine_and_the_next_start_chooses_by_it(tiny_dir, tmp_path, monkeypatch, capsys):
    """``verispec models --time REF`` (what README tells a user to run once): every installed engine timed and the
    timing stored, then the command line's auto chooses by it and says so."""
    from verispec.cli import build_parser, main, resolve_auto_backend

    timings = {"openvino": {"1": 30.0, "prefill": 0.4}, "transformers": {"1": 10.0, "prefill": 0.3}}
    timed = _fake_engines(monkeypatch, tmp_path, timings)
    assert main(["models", "--time", str(tiny_dir), "--threads", "2"]) == 0
    assert sorted(timed) == ["openvino", "transformers"] and "transformers" in capsys.readouterr().out
    monkeypatch.setenv("VERISPEC_BACKEND", "auto")
    args = build_parser().parse_args(["generate", "hi", "--target", str(tiny_dir), "--threads", "2"])
    resolve_auto_backend(args)
    assert args.backend == "transformers" and len(timed) == 2  # read back, nothing timed again
    assert "--backend auto chose transformers (as-is weights): timed on this CPU" in capsys.readouterr().err


def test_the_default_backend_comes_from_the_environment(monkeypatch):
    from verispec.errors import InvalidRequest

    monkeypatch.delenv("VERISPEC_BACKEND", raising=False)
    assert choice.default_backend() == "auto"
    monkeypatch.setenv("VERISPEC_BACKEND", "llamacpp")
    assert choice.default_backend() == "llamacpp"
    monkeypatch.setenv("VERISPEC_BACKEND", "tensorrt")
    with pytest.raises(InvalidRequest, match="VERISPEC_BACKEND"):
        choice.default_backend()
