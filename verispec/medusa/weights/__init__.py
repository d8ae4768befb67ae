"""Medusa heads that ship with verispec, one folder per built-in target (config.json + model.safetensors)."""

from __future__ import annotations

from pathlib import Path

from ...errors import ModelNotFound

HERE = Path(__file__).parent
SHIPPED = {"smollm2-135m": HERE / "smollm2-135m"}


def resolve_heads(target_name: str, ref: str | Path | None) -> Path:
    """The folder of a set of Medusa heads: ``ref`` when given, else the set shipped for the built-in target."""
    if ref is not None:
        path = Path(ref).expanduser()
        if not path.is_dir():
            raise ModelNotFound(f"Medusa heads folder {path} does not exist; pass the --out folder of "
                                "`verispec train-medusa`")
        return path
    if target_name in SHIPPED and (SHIPPED[target_name] / "config.json").exists():
        return SHIPPED[target_name]
    raise ModelNotFound(
        f"no Medusa heads ship for target {target_name!r} (shipped: {', '.join(SHIPPED)}). Train them with "
        f"`verispec train-medusa --target {target_name} --prompts FILE --out DIR` and pass them with --medusa-heads DIR")
