"""The llamacpp backend's weight-format choice (no llama.cpp needed: conversion and timing are replaced)."""

import json

import pytest

from verispec.backends import llamacpp
from verispec.errors import InvalidRequest


def test_auto_score_prefers_cheap_wide_passes_only_when_they_pay():
    quantized = {"1": 10.0, "2": 17.0, "5": 29.0, "9": 45.0}  # compute-bound: wide passes cost nearly linearly
    memory_bound = {"1": 20.0, "2": 21.0, "5": 23.0, "9": 26.0}  # wide passes nearly free
    assert llamacpp.auto_score(quantized) == 10.0  # plain steps are its best
    # its best is 5 tokens for 23 ms, committing (1 - 0.6^5) / 0.4 = 2.31 tokens: 9.97 ms per token
    assert llamacpp.auto_score(memory_bound) == pytest.approx(23.0 / ((1 - 0.6 ** 5) / 0.4))
    assert llamacpp.auto_score(memory_bound) < llamacpp.auto_score(quantized)
    # prefill counts with 1.5 prompt tokens per generated token: a slow prefill can decide
    slow_prefill = {**quantized, "prefill": 4.3}
    fast_prefill = {"1": 11.7, "2": 22.7, "5": 29.1, "9": 40.9, "prefill": 2.0}
    assert llamacpp.auto_score(slow_prefill) == pytest.approx(10.0 + 1.5 * 4.3)
    assert llamacpp.auto_score(fast_prefill) < llamacpp.auto_score(slow_prefill)


def test_auto_times_each_candidate_once_per_cpu_and_remembers(tmp_path, monkeypatch):
    monkeypatch.setenv("VERISPEC_COST_CACHE", str(tmp_path / "measurements"))
    source = tmp_path / "model.gguf"
    source.write_bytes(b"gguf")
    timings = {"as-is": {"1": 10.0, "2": 17.0, "5": 29.0, "9": 45.0},
               "f16": {"1": 12.0, "2": 13.0, "5": 14.0, "9": 16.0},
               "f32": {"1": 20.0, "2": 21.0, "5": 23.0, "9": 26.0}}
    timed = []
    monkeypatch.setattr(llamacpp, "convert_weights", lambda src, fmt, folder: tmp_path / f"{fmt}.gguf")
    monkeypatch.setattr(llamacpp, "time_widths", lambda path, threads: timed.append(path.stem) or timings[path.stem])
    chosen = llamacpp.choose_weights(source, "auto", tmp_path / "cache", threads=2)
    assert chosen.name == "f16" and chosen.path == tmp_path / "f16.gguf" and chosen.timings_ms == timings
    assert sorted(timed) == ["as-is", "f16", "f32"]
    (path,) = (tmp_path / "measurements").glob("llamacpp-weights-*.json")
    record = json.loads(path.read_text())
    assert record["value"]["choice"] == "f16" and record["key"]["threads"] == 2
    again = llamacpp.choose_weights(source, "auto", tmp_path / "cache", threads=2)
    assert again.name == "f16" and len(timed) == 3  # remembered: nothing timed again
    llamacpp.choose_weights(source, "auto", tmp_path / "cache", threads=1)
    assert len(timed) == 6  # another thread count is another measurement


def test_unknown_weight_format_names_the_choices(tmp_path):
    with pytest.raises(InvalidRequest, match="f16"):
        llamacpp.convert_weights(tmp_path / "m.gguf", "q3_k", tmp_path)
    assert llamacpp.convert_weights(tmp_path / "m.gguf", "as-is", tmp_path) == tmp_path / "m.gguf"


def test_missing_llama_cpp_python_names_the_install_command(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_llama(name, *args, **kwargs):
        if name == "llama_cpp":
            raise ImportError("No module named 'llama_cpp'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_llama)
    with pytest.raises(InvalidRequest, match=r'pip install "verispec\[llamacpp\]"'):
        llamacpp.import_llama_cpp()


def test_every_weight_format_is_offered_on_the_command_line():
    from verispec.backends import entry_options
    from verispec.backends.openvino.export import WEIGHTS as OPENVINO_WEIGHTS
    from verispec.cli import build_parser

    weights = entry_options()["weights"]  # one --weights, with the formats of every backend that takes it
    assert set(weights.choices) == set(llamacpp.WEIGHT_FORMATS) | {"auto"} | set(OPENVINO_WEIGHTS)
    assert "llamacpp: " in weights.help and "; openvino: " in weights.help
    for fmt in weights.choices:
        assert build_parser().parse_args(["generate", "hi", "--weights", fmt]).weights == fmt
    assert llamacpp.WEIGHT_FORMATS["bf16"] == 32  # LLAMA_FTYPE_MOSTLY_BF16 (llama.h)
