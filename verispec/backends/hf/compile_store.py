"""Compiled passes on disk (the one-token step, the verify program): AOTInductor packages keyed by everything that
changes the compiled code.

A package (``torch._inductor.aoti_compile_and_package``) holds the step's C++ kernels, its wrapper and the frozen
weights in one ``.pt2`` file; loading one takes about two seconds where compiling takes a minute or more. torch's
own on-disk caches do not serve here: with frozen weights inductor's FX graph cache keys a parameter by its shape
and dtype only, so a model with other weights of the same shapes would be handed the first model's kernels and
constants (measured: logits off by 1.5 after scaling two weight matrices), and oneDNN-packed constants bypass it.

So the key is verispec's own (``package_key``): a digest of the weights' bytes and the model's config, the dtype and
pass width (1, or the verify program's range such as "2-12"), the step's source code, the CPU (model, instruction-set
flags, the vector ISA torch dispatches to), the torch, transformers and Python versions, and the compile options. A
package is read only under exactly that key, so a changed model, CPU or version builds a new one and never uses a
stale one; building one removes the packages of the same weights and kind (the one-token step, or verify passes of
any range) under other keys (an older verispec, torch or CPU: ``superseded``), so they do not pile up. Packages are
written to a temporary name and renamed, so a stopped build leaves no half-written file under a real name; a file
that does not load is removed and built again.

Packages live under ``$VERISPEC_CACHE/compiled`` (``verispec.backends.references.cache_dir``) with a JSON file
beside each that records its key, build time and size (``verispec models`` lists them). The default model's
float32 packages are about 1.1 GB each (the weights as the kernels read them, and as the model holds them).
"""

from __future__ import annotations

import atexit
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
from contextlib import contextmanager
from pathlib import Path

import torch

FORMAT = 1  # bump when a package's meaning changes: older packages then sit under another key
OPTIONS = {"freezing": True, "max_autotune": True}  # what inductor compiles the step with
AUTOTUNE_ENV = "VERISPEC_COMPILE_AUTOTUNE"

log = logging.getLogger(__name__)


def options() -> dict:
    """What inductor compiles with: frozen weights and autotuned GEMM kernels. ``VERISPEC_COMPILE_AUTOTUNE=0``
    skips the autotuning (inductor's default kernel choices): a build takes about a third of the time and its
    kernels are slower (measured on the tiny llama of the tests: 44.6 against 120.1 s on 2 cores; on the default
    model autotuning made the one-token step ~1.9x faster, docs/kernels.md). For tests and quick experiments; the
    setting is part of the package key, so the two builds are never mistaken for each other."""
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

    return {"format": FORMAT, **machine(), "torch_capability": cpu_info().get("torch_capability"),
            "transformers": transformers.__version__, "python": platform.python_version(),
            "weights": weights_digest(model), "dtype": str(next(model.parameters()).dtype), "width": width,
            "source": hashlib.sha256(source.encode()).hexdigest()[:24], "options": options()}


def package_path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:24]
    return folder() / f"step-{digest}.pt2"


def compiler_missing() -> str | None:
    """Why inductor cannot build C++ here, or None: it needs a C++ compiler (``$CXX``, else g++ or clang++)."""
    if os.environ.get("CXX") and shutil.which(os.environ["CXX"]):
        return None
    if shutil.which("g++") or shutil.which("clang++"):
        return None
    return ("no C++ compiler found (inductor needs one to compile the step: install g++, e.g. `apt install g++`, "
            "or set CXX)")


def load(path: Path):
    """The runner of the package at ``path``, or None when there is none; a package that does not load is removed
    (it is rebuilt by the next compile)."""
    if not path.exists():
        return None
    try:
        # the loader unpacks the package (1 GB for the default model) into a temporary folder that it removes only
        # when the runner is freed, which a killed process never does. It unpacks into a folder named for this
        # process instead, removed when the process exits, or by the next load once the process is gone (not at
        # once after loading: nothing promises that the runner never reads its files again)
        with _environment("TMPDIR", _unpack_folder()):
            return torch._inductor.aoti_load_package(str(path))
    except Exception as exc:  # noqa: BLE001 - a damaged or foreign file: drop it, never run it
        log.warning("removing compiled package %s, which did not load (%s: %s)", path, type(exc).__name__,
                    str(exc).splitlines()[0] if str(exc) else "")
        remove(path)
        return None


def _unpack_folder() -> str:
    """A temporary folder for this process's unpacked packages (removed at exit); folders of processes that are gone
    (killed before their exit could remove them) are removed first."""
    for old in Path(tempfile.gettempdir()).glob("verispec-unpack-*"):
        pid = old.name.split("-")[2]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    folder = tempfile.mkdtemp(prefix=f"verispec-unpack-{os.getpid()}-")
    atexit.register(shutil.rmtree, folder, True)
    return folder


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextmanager
def _environment(name: str, value: str):
    """``os.environ[name] = value`` for the block (C code such as AOTInductor's loader reads it), then as before."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield value
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def save(exported, path: Path, key: dict, name: str) -> float:
    """Compile ``exported`` (a ``torch.export.ExportedProgram``) into a package at ``path``; returns the seconds."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.stem}.{os.getpid()}.partial.pt2")
    from torch._inductor import select_algorithm

    t0 = time.perf_counter()
    quiet, select_algorithm.PRINT_AUTOTUNE = select_algorithm.PRINT_AUTOTUNE, False  # a table per matmul otherwise
    # inductor's own cache would keep another copy of the library and weights (1 GB) for every build: build in a
    # folder of ours, removed afterwards (C++ kernels are then compiled afresh for every build; builds are rare)
    work = tempfile.mkdtemp(prefix="verispec-build-")
    try:
        with warnings.catch_warnings(), _environment("TORCHINDUCTOR_CACHE_DIR", work):
            warnings.simplefilter("ignore", FutureWarning)  # torch's own pytree deprecations
            # a copy of the options: inductor adds its own keys to the dict it is given
            torch._inductor.aoti_compile_and_package(exported, package_path=str(partial),
                                                     inductor_configs=options())
        seconds = time.perf_counter() - t0
        os.replace(partial, path)
    finally:
        select_algorithm.PRINT_AUTOTUNE = quiet
        partial.unlink(missing_ok=True)
        shutil.rmtree(work, ignore_errors=True)
    record = {"model": name, "built": time.strftime("%Y-%m-%d %H:%M:%S"), "compile_seconds": round(seconds, 1),
              "bytes": path.stat().st_size, "key": key}
    tmp = path.with_suffix(f".{os.getpid()}.json.tmp")
    tmp.write_text(json.dumps(record, indent=1, default=str))
    os.replace(tmp, path.with_suffix(".json"))
    for old in superseded(path, key):
        log.info("removing the compiled pass %s, superseded by %s", old, path.name)
        remove(old)
    return seconds


def superseded(path: Path, key: dict) -> list[Path]:
    """The stored packages that the package at ``path`` (under ``key``) replaces: the same weights and kind of pass
    (the one-token step, or verify passes of any range) under another key (an older verispec, torch, range of verify
    widths, or another CPU)."""
    return [Path(old["path"]) for old in records() if old["path"] != str(path)
            and old["key"].get("weights") == key["weights"] and (old["key"].get("width") == 1) == (key["width"] == 1)]


def remove(path: Path) -> None:
    path.unlink(missing_ok=True)
    path.with_suffix(".json").unlink(missing_ok=True)


def records() -> list[dict]:
    """The packages on disk, newest first: their model, build date, size and path."""
    out = []
    for meta in folder().glob("step-*.json"):
        try:
            record = json.loads(meta.read_text())
        except (OSError, ValueError):
            continue
        pt2 = meta.with_suffix(".pt2")
        if pt2.exists():
            out.append({**record, "path": str(pt2)})
    return sorted(out, key=lambda r: r.get("built", ""), reverse=True)


def source_of(*objects) -> str:
    """The code a compiled step runs (its module and attention function), part of the key."""
    return "\n".join(inspect.getsource(o) for o in objects)
