"""Probing an engine in a child process before trusting it: a child killed by a signal is a crash, named and
remembered per CPU and build; one that exits with an error is not (the caller meets the error itself); llama.cpp
refuses a build that crashes here with the command that rebuilds it without AMX. The crashes are real (the child
kills itself), so these run on every CPU."""

import subprocess

import pytest

from conftest import require_llama_cpp
from verispec.backends import probe as probe_module
from verispec.backends.probe import describe, probe
from verispec.errors import InvalidRequest

SEGFAULT = "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n"


def test_a_child_killed_by_a_signal_is_a_crash_named_and_remembered(tmp_path, monkeypatch):
    monkeypatch.setenv("VERISPEC_COST_CACHE", str(tmp_path))
    result = probe("a kernel", {"build": 1}, SEGFAULT)
    assert not result.ok and result.reason.startswith("SIGSEGV")
    (record,) = tmp_path.glob("probe-*.json")

    def no_child(*args, **kwargs):
        raise AssertionError("the stored answer is read, no child runs")

    monkeypatch.setattr(probe_module.subprocess, "run", no_child)
    assert probe("a kernel", {"build": 1}, SEGFAULT) == result
    with pytest.raises(AssertionError):
        probe("a kernel", {"build": 2}, SEGFAULT)  # another build is probed again


def test_a_child_that_exits_with_an_error_is_no_crash_and_is_not_stored(tmp_path, monkeypatch):
    monkeypatch.setenv("VERISPEC_COST_CACHE", str(tmp_path))
    result = probe("a loader", {}, "raise SystemExit('no such file')")
    assert result.ok and "no such file" in result.reason
    assert not list(tmp_path.glob("probe-*.json"))
    assert probe("a pass", {}, "print('fine')").ok


def test_a_child_that_hangs_is_a_failure(tmp_path, monkeypatch):
    monkeypatch.setenv("VERISPEC_COST_CACHE", str(tmp_path))
    result = probe("a hang", {}, "import time\ntime.sleep(30)", timeout=1)
    assert not result.ok and "no answer" in result.reason


def test_exit_descriptions_name_the_signal_or_the_last_error_line():
    assert describe(-4, "").startswith("SIGILL")
    assert describe(-8, "").startswith("SIGFPE")
    assert describe(1, "Traceback\n  ...\nValueError: bad\n") == "exit status 1: ValueError: bad"


def test_llama_cpp_refuses_a_build_that_crashes_here_and_names_the_rebuild(tmp_path, monkeypatch):
    require_llama_cpp()
    from verispec.backends import llamacpp

    monkeypatch.setenv("VERISPEC_COST_CACHE", str(tmp_path))
    monkeypatch.setattr(llamacpp, "_probe_code", lambda path, threads, extra_buffers=True: SEGFAULT)
    with pytest.raises(InvalidRequest) as info:
        llamacpp.LlamaCppModel(tmp_path / "model.gguf", None, "fake", threads=2)  # refused before any load
    message = str(info.value)
    assert "SIGSEGV" in message and "-DGGML_NATIVE=OFF" in message and "AMX" in message
    assert "pip install --force-reinstall" in message


def test_llama_cpp_runs_without_extra_buffers_where_only_they_crash(llama_q41, tmp_path, monkeypatch, caplog):
    """A build whose repacked (AMX) buffers crash but whose plain kernels run (a native build on an AMX Xeon) loads
    the model with llama.cpp's extra buffer types off, says so with the rebuild command, and still generates."""
    from verispec.backends import llamacpp

    monkeypatch.setenv("VERISPEC_COST_CACHE", str(tmp_path))
    real = llamacpp._probe_code
    monkeypatch.setattr(llamacpp, "_probe_code", lambda path, threads, extra_buffers=True:
                        SEGFAULT if extra_buffers else real(path, threads, extra_buffers))
    with caplog.at_level("WARNING"):
        model = llamacpp.LlamaCppModel(llama_q41.path, llama_q41.tokenizer, "q41")
    assert model.extra_buffers is False
    assert "--no-repack" in caplog.text and "-DGGML_NATIVE=OFF" in caplog.text
    kv = model.new_kv()
    first = model.forward(kv, [1, 2, 3]).logits
    assert first.shape[0] == 3 and bool(first.isfinite().all())
    assert len(list(tmp_path.glob("probe-*.json"))) == 2  # both answers remembered


def test_no_extra_buffers_turns_llama_cpp_repacking_off_while_open():
    llama_cpp = require_llama_cpp()
    from verispec.backends.llamacpp import no_extra_buffers

    assert llama_cpp.llama_model_default_params().use_extra_bufts
    with no_extra_buffers(llama_cpp):
        assert not llama_cpp.llama_cpp.llama_model_default_params().use_extra_bufts
    with no_extra_buffers(llama_cpp, off=False):
        assert llama_cpp.llama_cpp.llama_model_default_params().use_extra_bufts
    assert llama_cpp.llama_cpp.llama_model_default_params().use_extra_bufts


FAKE_SERVER = """#!{python}
import http.server, os, signal, sys
if "--no-repack" not in sys.argv:
    os.kill(os.getpid(), signal.SIGSEGV)  # a native build's AMX warm-up
port = int(sys.argv[sys.argv.index("--port") + 1])

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"{{}}")

http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def test_llama_server_that_crashes_at_start_is_started_again_without_repacking(tmp_path):
    import sys

    from verispec.bench.llama_server import LlamaServer

    binary = tmp_path / "llama-server"
    binary.write_text(FAKE_SERVER.format(python=sys.executable))
    binary.chmod(0o755)
    with LlamaServer(binary, tmp_path / "model.gguf", threads=1, start_timeout=30) as server:
        assert server.args[-1] == "--no-repack" and server.proc.poll() is None


def test_llama_server_that_crashes_without_repacking_too_is_refused_with_the_build_flags(tmp_path):
    import sys

    from verispec.bench.llama_server import LlamaServer

    binary = tmp_path / "llama-server"
    binary.write_text(f"#!{sys.executable}\n{SEGFAULT}")
    binary.chmod(0o755)
    with pytest.raises(InvalidRequest) as info:
        LlamaServer(binary, tmp_path / "model.gguf", threads=1, start_timeout=30)
    assert "SIGSEGV" in str(info.value) and "--no-repack too" in str(info.value)
    assert "-DGGML_NATIVE=OFF" in str(info.value)


def test_llama_cpp_probes_a_real_file_once(llama_q41, tmp_path, monkeypatch):
    """The built-in file's first pass runs in a child: fine on this CPU, and remembered."""
    from verispec.backends import llamacpp

    monkeypatch.setenv("VERISPEC_COST_CACHE", str(tmp_path))
    llamacpp.ensure_runs(llama_q41.path, 2)
    (record,) = tmp_path.glob("probe-*.json")
    calls = []
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: calls.append(a))
    llamacpp.ensure_runs(llama_q41.path, 2)
    assert not calls and "Q4_1" in record.read_text()


def test_ci_builds_llama_cpp_without_amx_where_the_cpu_has_it():
    """.ci/run's flags for AMX machines are the ones the refusal tells users to rebuild with."""
    from pathlib import Path

    from verispec.backends.llamacpp import NO_AMX_CMAKE_ARGS

    script = (Path(__file__).parent.parent / ".ci" / "run").read_text()
    assert "grep -qw amx_tile /proc/cpuinfo" in script and f'CMAKE_ARGS="{NO_AMX_CMAKE_ARGS}"' in script
    assert "AMX" not in NO_AMX_CMAKE_ARGS and "-DGGML_NATIVE=OFF" in NO_AMX_CMAKE_ARGS
