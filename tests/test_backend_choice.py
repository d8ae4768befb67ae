"""``--backend auto``: the installed engines that keep the model's own weights are timed once per model and CPU, the
choice is stored and read back, options only one backend takes decide it without timing, and the command line says
what it chose before it runs."""

import json

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


def test_auto_times_each_installed_engine_once_and_remembers(tiny_dir, tmp_path, monkeypatch):
    timings = {"openvino": {"1": 12.0, "2": 12.5, "9": 16.0, "prefill": 0.4},
               "transformers": {"1": 40.0, "2": 55.0, "9": 80.0, "prefill": 0.3}}
    timed = _fake_engines(monkeypatch, tmp_path, timings)
    picked = choice.choose(str(tiny_dir), fake_load, threads=2)
    assert (picked.backend, picked.weights) == ("openvino", "as-is") and sorted(timed) == sorted(timings)
    assert "openvino" in picked.reason and "transformers" in picked.reason
    (record,) = (tmp_path / "measurements").glob("backend-auto-*.json")
    assert json.loads(record.read_text())["value"]["choice"] == "openvino"
    assert choice.choose(str(tiny_dir), fake_load, threads=2).backend == "openvino" and len(timed) == 2  # read back
    choice.choose(str(tiny_dir), fake_load, threads=1)
    assert len(timed) == 4  # another thread count is another measurement


def test_the_faster_engine_wins_whichever_it_is(tiny_dir, tmp_path, monkeypatch):
    timings = {"openvino": {"1": 30.0, "2": 31.0, "prefill": 0.4}, "transformers": {"1": 10.0, "2": 11.0,
                                                                                     "prefill": 0.3}}
    _fake_engines(monkeypatch, tmp_path, timings)
    assert choice.choose(str(tiny_dir), fake_load, threads=2).backend == "transformers"


def test_only_engines_that_run_the_model_are_candidates(tiny_dir, monkeypatch):
    monkeypatch.setattr(choice, "installed", lambda backend: True)
    assert choice.candidates(str(tiny_dir)) == ["openvino", "transformers"]  # a folder: no GGUF for llama.cpp
    assert choice.candidates("smollm2-135m") == ["openvino", "llamacpp", "transformers"]
    assert choice.candidates("someone/some-model") == ["transformers"]  # a hub id: OpenVINO exports local models
    monkeypatch.setattr(choice, "installed", lambda backend: backend == "transformers")
    picked = choice.choose("smollm2-135m", fake_load)
    assert picked.backend == "transformers" and "not installed: openvino, llamacpp" in picked.reason


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


def test_the_default_backend_comes_from_the_environment(monkeypatch):
    from verispec.errors import InvalidRequest

    monkeypatch.delenv("VERISPEC_BACKEND", raising=False)
    assert choice.default_backend() == "auto"
    monkeypatch.setenv("VERISPEC_BACKEND", "llamacpp")
    assert choice.default_backend() == "llamacpp"
    monkeypatch.setenv("VERISPEC_BACKEND", "tensorrt")
    with pytest.raises(InvalidRequest, match="VERISPEC_BACKEND"):
        choice.default_backend()
