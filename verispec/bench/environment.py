"""What a benchmark ran on, so that two runs can be compared honestly."""

from __future__ import annotations

import datetime
import os
import platform
from importlib import metadata

import torch


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(dtype: str, device: str, packed_layers: int = 0) -> dict:
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": {p: _version(p) for p in ("verispec", "torch", "transformers", "tokenizers")},
        "python": platform.python_version(),
        "dtype": dtype,
        "device": device,
        "packed_linear_layers": packed_layers,  # weights prepacked for oneDNN (verispec.packing; VERISPEC_PACK=0 off)
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "cpu": _cpu_model(),
        "machine": f"{platform.system()} {platform.release()} {platform.machine()}",
        "hostname": platform.node(),
    }
