"""What a benchmark ran on, so that two runs can be compared honestly: versions, the CPU with its instruction-set
flags, and the kernels the model's linear layers ran on."""

from __future__ import annotations

import datetime
import os
import platform
from importlib import metadata

import torch

from ..backends.torch_cpu.cpu import cpu_info, linear_kernel


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def environment(dtype: str, device: str, packed_layers: int = 0, kernel: str | None = None,
                backend: str = "transformers") -> dict:
    """``kernel`` is what the target's linears ran on (``TargetModel.kernel``); the ``kernels`` block says what this
    CPU would run for each dtype with packing on (probed, not read off a list)."""
    cpu = cpu_info()
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": {p: _version(p) for p in ("verispec", "torch", "transformers", "tokenizers",
                                                    "llama_cpp_python")},
        "python": platform.python_version(),
        "backend": backend,
        "dtype": dtype,
        "device": device,
        "linear_kernel": kernel,
        "packed_linear_layers": packed_layers,  # weights prepacked for oneDNN (verispec.backends.torch_cpu.packing; VERISPEC_PACK=0 off)
        "kernels": {name: linear_kernel(dt) for name, dt in (("float32", torch.float32), ("bfloat16", torch.bfloat16))},
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "cpu": cpu["model"],
        "cpu_flags": cpu["flags"],
        "torch_cpu_capability": cpu["torch_capability"],
        "machine": f"{platform.system()} {platform.release()} {platform.machine()}",
        "hostname": platform.node(),
        # settings that change what runs (VERISPEC_PACK, VERISPEC_COMPILE_AUTOTUNE, VERISPEC_LLAMACPP_LAYER_INPUTS...)
        "settings": {k: v for k, v in sorted(os.environ.items()) if k.startswith("VERISPEC_") and "TOKEN" not in k},
    }
