"""In-process A/B of the instruction set of the block kernel's products over 1 or 2 rows (``blockmm.set_narrow_isa``,
docs/kernels.md): on an AVX-512 CPU, the AVX-512 one-row paths against the 256-bit ones (``vnni256``), each with the
other paths ``blockmm.choose_paths`` keeps when the narrow products are on it (one-row limits, prefetch distance, Q6_K
tiles). One model loaded once; each round takes every set in turn, passes of each width after --context cached tokens;
medians in ms (the first round dropped). The logits are checked equal first.

    python experiments/narrow_isa_ab.py --target qwen2.5-coder-1.5b --widths 1,2 --rounds 8
"""

import argparse

import verispec.blockmm as blockmm
from pass_settings import prefilled, same_logits, time_settings
from verispec import load_model
from verispec.backends.block_modules import BlockLinear


def _settings() -> dict:
    return {"narrow": blockmm.narrow_isa(), "wide": blockmm.wide_isa(), "prefetch": blockmm.prefetch(),
            "one_row": blockmm.one_row_limits(), "q6k_tiles": blockmm.q6k_tiles()}


def _apply(settings: dict) -> None:
    blockmm.set_narrow_isa(settings["narrow"])
    blockmm.set_wide_isa(settings["wide"])
    blockmm.set_prefetch(settings["prefetch"])
    for kind, rows in settings["one_row"].items():
        blockmm.set_one_row_limit(kind, rows)
    blockmm.set_q6k_tiles(settings["q6k_tiles"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--widths", default="1,2")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--context", type=int, default=256)
    args = ap.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    model = load_model(args.target, backend="blocks", threads=2)
    kept = blockmm.narrow_isa()
    print("kernel:", model.linear_kernel, "| narrow set kept at load:", kept)
    matrices = [m._matrix for m in model.model.modules() if isinstance(m, BlockLinear)]  # what the load timed
    chosen = {}
    for name in blockmm.NARROW_CANDIDATES:
        if name in blockmm.isas():
            blockmm.NARROW_CANDIDATES, every = (name,), blockmm.NARROW_CANDIDATES
            blockmm.choose_paths(matrices)
            blockmm.NARROW_CANDIDATES = every
            chosen[name] = _settings()
            print(f"  {name}: {chosen[name]}")
    settings = {name: (lambda s=s: _apply(s)) for name, s in chosen.items()}
    kv = prefilled(model, args.context)
    print("the same logits on every set:", same_logits(model, kv, args.context, settings, [5, 17]))
    took = time_settings(model, kv, args.context, settings, widths, args.rounds)
    _apply(chosen[kept])
    for (name, w), ms in took.items():
        print(f"  {name:12s} w={w}: {ms:.1f} ms")


if __name__ == "__main__":
    main()
