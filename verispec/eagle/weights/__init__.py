"""EAGLE heads that ship with verispec, one folder per built-in target (config.json + model.safetensors)."""

from __future__ import annotations

from pathlib import Path

from ...errors import ModelNotFound

HERE = Path(__file__).parent
SHIPPED = {"smollm2-135m": HERE / "smollm2-135m"}  # four fused layers (EAGLE-3's features)
# heads on the target's final normed state alone (`train-eagle --layers N`): on llama.cpp that state is the
# embeddings output of a pass, so they draft with no eval callback; the default there
SHIPPED_FINAL = {"smollm2-135m": HERE / "smollm2-135m-final"}
NAMED = {"fused": SHIPPED, "final": SHIPPED_FINAL}  # --eagle-head NAME picks a shipped head by its features


def resolve_head(target_name: str, ref: str | Path | None, prefer_final: bool = False) -> Path:
    """The folder of an EAGLE head: ``ref`` when given (a folder, or ``fused`` / ``final`` for a shipped head),
    else the head shipped for the built-in target (``prefer_final``: the one on the final normed state alone, for a
    target that returns that state without asking, as llama.cpp does)."""
    if ref is not None and str(ref) not in NAMED:
        path = Path(ref).expanduser()
        if not path.is_dir():
            raise ModelNotFound(f"EAGLE head folder {path} does not exist; pass the --out folder of "
                                f"`verispec train-eagle`, or {' or '.join(NAMED)} for a shipped head")
        return path
    shipped = NAMED[str(ref)] if ref is not None else SHIPPED_FINAL if prefer_final else SHIPPED
    if target_name in shipped and (shipped[target_name] / "config.json").exists():
        return shipped[target_name]
    raise ModelNotFound(
        f"no EAGLE head ships for target {target_name!r} (shipped: {', '.join(SHIPPED)}). Train one with "
        f"`verispec train-eagle --target {target_name} --prompts FILE --out DIR` and pass it with --eagle-head DIR"
    )
