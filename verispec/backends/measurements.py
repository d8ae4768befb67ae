"""Measurements that outlive the process: timings keyed by everything that changes them.

What a target pass costs depends on the weights, the backend and its weight format, the dtype, whether the step is
compiled, the threads, the CPU (model and instruction-set flags) and the software (verispec, torch, llama.cpp). A
record is read only when every one of those is the same (the key holds them all), so a record from another CPU,
model or version is never used. Each record is one small JSON file, written atomically, under
``$VERISPEC_CACHE/measurements`` (see ``verispec.backends.cache.cache_dir``).

``VERISPEC_COST_CACHE=0`` turns the store off (nothing is read or written); a path there moves it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

ENV = "VERISPEC_COST_CACHE"
FORMAT = 1  # bump when a record's meaning changes: older records are then a different key

log = logging.getLogger(__name__)


def enabled() -> bool:
    return os.environ.get(ENV, "").strip().lower() not in ("0", "false", "no", "off")


def folder() -> Path:
    """Where records live: $VERISPEC_COST_CACHE when it names a folder, else the cache folder's measurements/."""
    env = os.environ.get(ENV, "").strip()
    if env and env.lower() not in ("1", "true", "yes", "on"):
        return Path(env).expanduser()
    from .cache import cache_dir

    return cache_dir() / "measurements"


def machine() -> dict[str, Any]:
    """The parts of a key every measurement shares: CPU model and flags, and the software that runs the pass."""
    import torch

    from ..version import __version__
    from .torch_cpu.cpu import cpu_info

    info = cpu_info()
    return {"cpu": info["model"], "cpu_flags": list(info["flags"]), "verispec": __version__,
            "torch": torch.__version__, "format": FORMAT}


def file_fingerprint(path: str | Path) -> str:
    """A cheap identity of a weights file or folder: resolved path, sizes and modification times (a changed or
    replaced file is another model)."""
    path = Path(path).expanduser().resolve()
    files = [path] if path.is_file() else sorted(p for p in path.glob("*") if p.is_file()
                                                 and p.suffix in (".safetensors", ".bin", ".gguf", ".json"))
    parts = [str(path)] + [f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]


def _path(kind: str, key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]
    return folder() / f"{kind}-{digest}.json"


def load(kind: str, key: dict | None) -> Any | None:
    """The value stored under exactly this key, or None (no record, the store is off, or an unreadable file)."""
    if key is None or not enabled():
        return None
    path = _path(kind, key)
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("ignoring unreadable measurement record %s (%s)", path, exc)
        return None
    if record.get("key") != json.loads(json.dumps(key, default=str)):  # a hash collision, or a hand-edited file
        return None
    return record.get("value")


def save(kind: str, key: dict | None, value: Any) -> Path | None:
    """Store ``value`` under ``key`` (replacing what was there); None when the store is off or not writable."""
    if key is None or not enabled():
        return None
    path = _path(kind, key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        partial.write_text(json.dumps({"kind": kind, "key": key, "saved": time.time(), "value": value},
                                      indent=1, default=str))
        partial.replace(path)  # atomic: a reader sees the old record or the new one
    except OSError as exc:
        log.warning("could not store a measurement in %s (%s); it will be measured again next time", path, exc)
        return None
    return path


def records() -> list[dict]:
    """Every stored record (kind, key, saved time, path, and ``choice``: what an auto record (``--weights`` or
    ``--static-widths``) chose, else None), newest first."""
    found = []
    base = folder()
    if not base.is_dir():
        return found
    for path in base.glob("*.json"):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        value = record.get("value")
        found.append({"kind": record.get("kind"), "key": record.get("key"), "saved": record.get("saved"),
                      "path": str(path), "choice": value.get("choice") if isinstance(value, dict) else None})
    return sorted(found, key=lambda r: -(r["saved"] or 0))
