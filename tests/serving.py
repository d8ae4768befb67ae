"""Start ``verispec serve`` in a subprocess on a free loopback port, for tests that talk HTTP to it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *args: str, timeout: float = 180.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "verispec", "serve", "--port", str(self.port), "--log-level", "warning", *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.proc.stdout.read()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("server did not come up in time")

    def alive(self) -> bool:
        return self.proc.poll() is None

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

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.stdout.read() if self.proc.stdout else ""
