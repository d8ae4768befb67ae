"""Run an engine's first pass in a child process before this process trusts it: a kernel that kills its process.

Some builds crash on some CPUs instead of failing: llama.cpp built with ``-march=native`` on an Intel Xeon with AMX
dies with a general protection fault in its AMX matmul on the first pass; OpenVINO's bf16 compile died with a
floating point exception on the same machine. A crash in the serving process takes every request with it (and in a
test run, a pytest-xdist worker), so a backend about to run something untried runs it first in a child
(``probe``), and refuses with an error that names the cause and the fix when the child dies. The answer is stored
with the other measurements, keyed by the CPU, its flags and what the child ran, so each build and CPU pays the probe
once.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
from dataclasses import dataclass

from . import measurements

log = logging.getLogger(__name__)

RECORD = "probe"  # the kind of record a probe's answer is stored as
TIMEOUT_S = 300


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    reason: str = ""  # what killed the child ("SIGSEGV (segmentation fault)", "exit status 1: ...")


def describe(returncode: int, stderr: str) -> str:
    """How a child ended, in words: the signal that killed it, or its exit status and last error line."""
    if returncode < 0:
        try:
            sig = signal.Signals(-returncode)
            return f"{sig.name} ({signal.strsignal(sig) or 'killed'})"
        except ValueError:
            return f"signal {-returncode}"
    last = next((line for line in reversed(stderr.strip().splitlines()) if line.strip()), "")
    return f"exit status {returncode}" + (f": {last[-300:]}" if last else "")


def probe(what: str, key: dict, code: str, timeout: float = TIMEOUT_S) -> ProbeResult:
    """Run ``code`` with this Python in a child process, once per ``key`` (the answer stored): not ok when a signal
    killed the child (or it hung past ``timeout``). A child that exits with an error is no crash: the caller goes
    on and meets the same error with its own message, and nothing is stored."""
    full_key = {**measurements.machine(), "what": what, **key}
    known = measurements.load(RECORD, full_key)
    if known is not None:
        return ProbeResult(bool(known.get("ok")), known.get("reason", ""))
    log.info("probing %s in a child process (once on this CPU and build) ...", what)
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        result = ProbeResult(False, f"no answer in {timeout:.0f} s")
    else:
        if done.returncode > 0:
            log.info("%s: the child exited with an error (%s)", what, describe(done.returncode, done.stderr))
            return ProbeResult(True, describe(done.returncode, done.stderr))
        result = ProbeResult(done.returncode == 0, describe(done.returncode, done.stderr) if done.returncode else "")
    if not result.ok:
        log.warning("%s crashed in a child process: %s", what, result.reason)
    measurements.save(RECORD, full_key, {"ok": result.ok, "reason": result.reason})
    return result
