"""``--compile auto`` on a server: compile the one-token step in the background, keep answering, switch when ready.

The compile runs in a child process (``verispec compile``) at the lowest CPU priority with one thread, so requests
keep the cores they need and a compiler crash cannot take the server down. The child stores the step in the compile
cache (``verispec.backends.torch_cpu.compile_store``); this process then loads it (about two seconds, in this thread) and
sets it on the target. Requests that started before keep their eager caches; the next ones run compiled one-token
steps. The controller's cost curve of the target is dropped at the switch, because one-token passes got cheaper.
The next server on the same machine finds the step stored and starts compiled. The child also stores the draft
step of the EAGLE head shipped for the target; EAGLE drafters built before the switch take it at their next request
(``EagleDrafter.reset``).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time

log = logging.getLogger(__name__)

STATES = ("eager", "compiling", "compiled", "failed")


def _lowest_priority() -> None:  # runs in the child before exec (POSIX)
    try:
        os.nice(19)
    except OSError:
        pass
    _die_with_parent()


def _die_with_parent() -> None:
    """Linux: the child gets SIGTERM when the thread that started it ends (its server process killed, even by
    SIGKILL), so a compile never outlives the server."""
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class BackgroundCompile:
    """Compile ``target``'s one-token step (a ``LoadedModel`` loaded from ``ref``) while the server runs."""

    def __init__(self, target, ref: str) -> None:
        self.target, self.ref = target, ref
        self.state = "compiled" if target.step is not None else "eager"
        self.seconds: float | None = None
        self._thread: threading.Thread | None = None
        self._child: subprocess.Popen | None = None
        self._stopped = False

    def start(self) -> None:
        if self.state != "eager" or self._thread is not None:
            return
        self.state = "compiling"
        self._thread = threading.Thread(target=self._run, name="verispec-compile", daemon=True)
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def stop(self, timeout: float = 10.0) -> None:
        """End the compile child if it still runs (the server is shutting down); the step stays eager."""
        self._stopped = True
        child = self._child
        if child is not None and child.poll() is None:
            log.warning("stopping the background compile (pid %d)", child.pid)
            child.terminate()
            try:
                child.wait(timeout)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        self.join(timeout)

    def command(self) -> list[str]:
        return [sys.executable, "-m", "verispec.cli", "compile", "--target", self.ref, "--threads", "1"]

    def _run(self) -> None:
        t0 = time.perf_counter()
        log.warning("compiling the one-token step of %s in the background (about a minute; requests run eagerly "
                    "until it is ready)", self.ref)
        try:
            if self._stopped:
                raise RuntimeError("the server is stopping")
            self._child = subprocess.Popen(self.command(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                           text=True, preexec_fn=_lowest_priority if os.name == "posix" else None,
                                           env={**os.environ, "OMP_NUM_THREADS": "1"})
            _, stderr = self._child.communicate()
            if self._child.returncode != 0:
                reason = (stderr.strip().splitlines() or ["no output"])[-1]
                raise RuntimeError(f"verispec compile exited with {self._child.returncode}: {reason}")
            if not self.target.compile_step(cached_only=True):
                raise RuntimeError("the stored step did not load")
        except Exception as exc:  # noqa: BLE001 - the server keeps answering eagerly whatever went wrong
            self.state = "failed"
            log.warning("background compile failed (%s); decoding stays eager", exc)
            return
        self.seconds = time.perf_counter() - t0
        self.state = "compiled"
        log.warning("one-token steps of %s now run compiled (ready after %.0f s)", self.ref, self.seconds)
