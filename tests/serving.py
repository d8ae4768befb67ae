"""Start ``verispec serve`` in a subprocess on a free loopback port, for tests that talk HTTP to it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """The server's output goes to a temporary file, not a pipe: nobody reads a pipe while the server runs, and a
    chatty server (Ray forwards every replica's log lines) would block on a full pipe before it ever answered."""

    def __init__(self, *args: str, timeout: float = 180.0, env: dict[str, str | None] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"),
               **(env or {})}
        env = {key: value for key, value in env.items() if value is not None}  # None: unset it
        self.log = tempfile.TemporaryFile(mode="w+", prefix="verispec-serve-", suffix=".log")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "verispec", "serve", "--port", str(self.port), "--log-level", "warning", *args],
            stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT, text=True, env=env,
        )
        started = time.monotonic()
        while time.monotonic() < started + timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        output = self.stop()
        raise RuntimeError(f"server did not answer /health within {timeout:.0f} s; its output:\n{output[-20000:]}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def output(self) -> str:
        """Everything the server has printed so far."""
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def metric(self, name: str, labels: str = "") -> float:
        """The value of one sample from /metrics (0 when absent)."""
        key = f"{name}{{{labels}}}" if labels else name
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith(key + " "):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def client(self, timeout: float = 300):
        """The official openai client pointed at this server (no retries: a 429 must show)."""
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=timeout)

    def stop(self, timeout: float = 15) -> str:
        """Terminate the server (kill it after ``timeout`` s) and return everything it printed."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.output()
