"""Compiled passes on disk (the one-token step, the verify program): AOTInductor libraries keyed by everything that
changes the compiled code.

A build (``torch._inductor.aoti_compile_and_package``) writes a package that holds the pass's C++ kernels, its
wrapper and the frozen weights in one shared library; the store keeps that library alone (``.so``), taken out of
the package once at build time, and loads it with AOTInductor's CPU runner, a few times faster than loading the
package, which unpacks its library again each time (docs/kernels.md); the same programs' logits, bitwise. torch's own on-disk caches do not serve here: with frozen weights inductor's FX graph cache
keys a parameter by its shape and dtype only, so a model with other weights of the same shapes would be handed the
first model's kernels and constants (measured: logits off by 1.5 after scaling two weight matrices), and
oneDNN-packed constants bypass it.

So the key is verispec's own (``package_key``): a digest of the weights' bytes and the model's config, the dtype and
pass width (1, or the verify program's range such as "2-12"), the step's source code, the CPU (model, instruction-set
flags, the vector ISA torch dispatches to), the torch, transformers and Python versions, the compile options and the
store's format. A library is read only under exactly that key, so a changed model, CPU or version builds a new one
and never uses a stale one. Every key keeps its own library: two environments sharing one cache (two torch versions,
two CPUs behind one network folder) each find theirs instead of deleting the other's and rebuilding forever. What
bounds the folder is its size: after a build, the least recently used libraries (loading one marks it used) are
removed until the folder is under ``$VERISPEC_COMPILED_CACHE_GB`` (default 8), the new one never; ``verispec cache
prune`` does the same on demand. Libraries are written to a temporary name and renamed, so a stopped build
leaves no half-written file under a real name; a file that does not load is removed and built again.

Libraries live under ``$VERISPEC_CACHE/compiled`` (``verispec.backends.references.cache_dir``) with a JSON file
beside each that records its key, build time and size (``verispec models`` lists them). The default model's
float32 libraries are about 1.1 GB each (the weights as the kernels read them, and as the model holds them).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
import platform
import shutil
import tempfile
import time
import warnings
import zipfile
from contextlib import contextmanager
from pathlib import Path

import torch

FORMAT = 2  # bump when a stored file's meaning changes: older ones then sit under another key (1: .pt2 packages)
LEGACY_SUFFIX = ".pt2"  # format 1 stored whole packages; still listed and superseded, never loaded
# What inductor compiles the step with. The generated wrapper (the C++ that calls the kernels in turn, no loops worth
# optimizing) is compiled at -O0: 7-8 s of g++ for the default model's where -O1 took 12-15 s, the step no slower.
# Inductor's precompiled headers stay on: built once a machine (~10 s), they save ~3 s on every later compile
# (docs/kernels.md)
OPTIONS = {"freezing": True, "max_autotune": True, "aot_inductor.compile_wrapper_opt_level": "O0"}
AUTOTUNE_ENV = "VERISPEC_COMPILE_AUTOTUNE"
CAP_ENV = "VERISPEC_COMPILED_CACHE_GB"
DEFAULT_CAP_GB = 8.0

log = logging.getLogger(__name__)


def options() -> dict:
    """What inductor compiles with: frozen weights, autotuned GEMM kernels, the wrapper at -O0 (``OPTIONS``).
    ``VERISPEC_COMPILE_AUTOTUNE=0`` skips the autotuning (inductor's default kernel choices): a build takes about a
    third of the time and its kernels are slower (docs/kernels.md). For tests and quick experiments; the setting is
    part of the package key, so the two builds are never mistaken for each other."""
    value = os.environ.get(AUTOTUNE_ENV, "1").strip().lower()
    if value not in ("0", "1", "false", "true", "no", "yes", "off", "on"):
        raise ValueError(f"{AUTOTUNE_ENV}={value!r}: use 1 (autotune the kernels, the default) or 0 (skip it)")
    return {**OPTIONS, "max_autotune": value in ("1", "true", "yes", "on")}


def folder() -> Path:
    from ..references import cache_dir

    return cache_dir() / "compiled"


def weights_digest(model: torch.nn.Module) -> str:
    """A digest of every parameter's and buffer's bytes (shared tensors once), names, shapes and dtypes, and the
    config: two models with the same digest compute the same function. About half a second per GB."""
    h = hashlib.blake2b(digest_size=16)
    seen: set[int] = set()
    tensors = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers())}
    for name in sorted(tensors):
        tensor = tensors[name]
        h.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        if tensor.is_mkldnn or tensor.device.type == "meta":
            continue
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        data = tensor.detach().contiguous().cpu()
        h.update(data.reshape(-1).view(torch.uint8).numpy() if data.numel() else b"")
    config = getattr(model, "config", None)
    if config is not None:
        h.update(config.to_json_string(use_diff=False).encode())
    return h.hexdigest()


def package_key(model: torch.nn.Module, width: int, source: str) -> dict:
    """Everything a compiled step depends on (see the module docstring); ``source`` is the step's code."""
    import transformers

    from ..measurements import machine
    from .cpu import cpu_info

    # machine() carries the measurement records' own "format": the store's comes after it (it had been overridden,
    # so FORMAT never reached the key)
    return {**machine(), "format": FORMAT, "torch_capability": cpu_info().get("torch_capability"),
            "transformers": transformers.__version__, "python": platform.python_version(),
            "weights": weights_digest(model), "dtype": str(next(model.parameters()).dtype), "width": width,
            "source": hashlib.sha256(source.encode()).hexdigest()[:24], "options": options()}


def package_path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:24]
    return folder() / f"step-{digest}.so"


def compiler_missing() -> str | None:
    """Why inductor cannot build C++ here, or None: it needs a C++ compiler (``$CXX``, else g++ or clang++)."""
    if os.environ.get("CXX") and shutil.which(os.environ["CXX"]):
        return None
    if shutil.which("g++") or shutil.which("clang++"):
        return None
    return ("no C++ compiler found (inductor needs one to compile the step: install g++, e.g. `apt install g++`, "
            "or set CXX)")


class Library:
    """A stored library, called as the package it came from would be (``AOTICompiledModel``): the positional
    arguments flattened to tensors, the outputs put back into the exported program's structure."""

    def __init__(self, path: Path) -> None:
        from torch.utils import _pytree as pytree

        self._pytree = pytree
        self._runner = torch._C._aoti.AOTIModelContainerRunnerCpu(str(path), 1)
        self._out_spec = pytree.treespec_loads(self._runner.get_call_spec()[1])

    def __call__(self, *args):
        flat = [x for x in self._pytree.tree_flatten((args, {}))[0] if isinstance(x, torch.Tensor)]
        return self._pytree.tree_unflatten(self._runner.run(flat), self._out_spec)


def load(path: Path) -> Library | None:
    """The library at ``path``, ready to call, or None when there is none; a library that does not load is removed
    (it is rebuilt by the next compile)."""
    if not path.exists():
        return None
    try:
        library = Library(path)
        mark_used(path)
        return library
    except Exception as exc:  # noqa: BLE001 - a damaged or foreign file: drop it, never run it
        log.warning("removing compiled library %s, which did not load (%s: %s)", path, type(exc).__name__,
                    str(exc).splitlines()[0] if str(exc) else "")
        remove(path)
        return None


@contextmanager
def _environment(name: str, value: str):
    """``os.environ[name] = value`` for the block (inductor reads TORCHINDUCTOR_CACHE_DIR from it), then as before."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield value
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


@contextmanager
def _elapsed(what: str):
    """A line on a terminal's stderr counting the seconds of a long step (a build takes minutes); nothing elsewhere."""
    import threading

    from tqdm.auto import tqdm

    bar = tqdm(desc=what, bar_format="{desc}: {elapsed}", disable=None, leave=False)
    done = threading.Event()

    def tick() -> None:
        while not done.wait(1.0):
            bar.refresh()

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()
        bar.close()


def save(exported, path: Path, key: dict, name: str) -> float:
    """Compile ``exported`` (a ``torch.export.ExportedProgram``) and store its library at ``path``; returns the
    seconds."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.stem}.{os.getpid()}.partial.pt2")
    library = path.with_name(f"{path.stem}.{os.getpid()}.partial.so")
    from torch._inductor import select_algorithm

    t0 = time.perf_counter()
    quiet, select_algorithm.PRINT_AUTOTUNE = select_algorithm.PRINT_AUTOTUNE, False  # a table per matmul otherwise
    # inductor's own cache would keep another copy of the library and weights (1 GB) for every build: build in a
    # folder of ours, removed afterwards (C++ kernels are then compiled afresh for every build; builds are rare)
    work = tempfile.mkdtemp(prefix="verispec-build-")
    try:
        with warnings.catch_warnings(), _environment("TORCHINDUCTOR_CACHE_DIR", work), \
                _elapsed(f"compiling {name} ({'one-token step' if key.get('width') == 1 else 'passes'})"):
            warnings.simplefilter("ignore", FutureWarning)  # torch's own pytree deprecations
            # a copy of the options: inductor adds its own keys to the dict it is given
            torch._inductor.aoti_compile_and_package(exported, package_path=str(partial),
                                                     inductor_configs=options())
        seconds = time.perf_counter() - t0
        _take_library(partial, library)
        os.replace(library, path)
    finally:
        select_algorithm.PRINT_AUTOTUNE = quiet
        partial.unlink(missing_ok=True)
        library.unlink(missing_ok=True)
        shutil.rmtree(work, ignore_errors=True)
    record = {"model": name, "built": time.strftime("%Y-%m-%d %H:%M:%S"), "compile_seconds": round(seconds, 1),
              "bytes": path.stat().st_size, "key": key}
    tmp = path.with_suffix(f".{os.getpid()}.json.tmp")
    tmp.write_text(json.dumps(record, indent=1, default=str))
    os.replace(tmp, path.with_suffix(".json"))
    prune(cap_bytes(), keep=(path,))
    return seconds


def cap_bytes() -> int:
    """The size the store is pruned to after a build (``$VERISPEC_COMPILED_CACHE_GB``, default 8)."""
    raw = os.environ.get(CAP_ENV, "").strip()
    try:
        gb = float(raw) if raw else DEFAULT_CAP_GB
    except ValueError:
        raise ValueError(f"{CAP_ENV}={raw!r}: give a size in GB, such as 8") from None
    return int(gb * 1e9)


def prune(max_bytes: int, keep=()) -> list[Path]:
    """Remove the least recently used libraries (by their record's time: built, or last loaded) until the store
    holds at most ``max_bytes``; never those in ``keep``. Returns what was removed."""
    keep = {str(k) for k in keep}
    found = sorted(records(), key=lambda r: r["used"])  # least recently used first
    sizes = [Path(r["path"]).stat().st_size for r in found]
    total = sum(sizes)
    removed = []
    for record, size in zip(found, sizes):
        if total <= max_bytes:
            break
        if record["path"] in keep:
            continue
        log.info("removing the compiled pass %s (least recently used; the store is capped at %.1f GB)",
                 Path(record["path"]).name, max_bytes / 1e9)
        remove(Path(record["path"]))
        total -= size
        removed.append(Path(record["path"]))
    return removed


def mark_used(path: Path) -> None:
    """Record that the library at ``path`` was just loaded (its record's time), for the least-recently-used order."""
    try:
        os.utime(path.with_suffix(".json"))
    except OSError:
        pass


def _take_library(package: Path, to: Path) -> None:
    """Copy the one shared library of an AOTInductor package (a zip archive) to ``to``."""
    with zipfile.ZipFile(package) as archive:
        libraries = [name for name in archive.namelist() if name.endswith(".so")]
        if len(libraries) != 1:
            raise RuntimeError(f"expected one library in the compiled package, found {len(libraries)}")
        with archive.open(libraries[0]) as src, open(to, "wb") as dst:
            shutil.copyfileobj(src, dst, 16 << 20)


def remove(path: Path) -> None:
    """Remove a stored program: its file in either format and its record."""
    for suffix in (".so", LEGACY_SUFFIX, ".json"):
        path.with_suffix(suffix).unlink(missing_ok=True)


def records() -> list[dict]:
    """The libraries on disk (format-1 packages too), newest first: their model, build date, size and path."""
    out = []
    for meta in folder().glob("step-*.json"):
        try:
            record = json.loads(meta.read_text())
        except (OSError, ValueError):
            continue
        stored = next((p for p in (meta.with_suffix(".so"), meta.with_suffix(LEGACY_SUFFIX)) if p.exists()), None)
        if stored is not None:
            out.append({**record, "path": str(stored), "used": meta.stat().st_mtime})
    return sorted(out, key=lambda r: r.get("built", ""), reverse=True)


def source_of(*objects) -> str:
    """The code a compiled step runs (its module and attention function), part of the key."""
    return "\n".join(inspect.getsource(o) for o in objects)
