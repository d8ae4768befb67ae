"""Whole passes of the blocks backend with its matrices in the file's layout and laid out 16 rows at a time
(``blockmm.pack16``), toggled in place in one process and interleaved round by round: the fair comparison on a VM
whose speed drifts by tens of percent over minutes (and for ~20 s after a load). Prints the median ms per width and
the ratio (docs/kernels.md, "the 16-row layout"). The types toggled: those given, by default every type this CPU reads
in that layout (all on AVX-512 VNNI, the 32-weight types on AVX2).

    python experiments/pack16_ab.py [--target qwen2.5-coder-1.5b] [--widths 1,2,4,8,16] [--rounds 4] [--kinds Q4_K,Q6_K]
"""

import argparse
import statistics
import sys

from verispec import blockmm
from verispec.blockmm.formats import TYPES
from verispec.backends import load_model
from verispec.backends.block_modules import BlockLinear
from verispec.backends.blocks import _matrices
from verispec.backends.timing import time_passes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--widths", default="1,2,4,8,16")
    ap.add_argument("--rounds", type=int, default=4, help="rounds of both layouts (each a median of 3 passes a width)")
    ap.add_argument("--kinds", default="", help="the block types toggled (default: every type this CPU lays out)")
    ap.add_argument("--context", type=int, default=256)
    args = ap.parse_args()
    kinds = set(args.kinds.split(",")) if args.kinds else {kind for kind in TYPES if blockmm.can_pack16(kind, 16)}
    if not kinds or not all(blockmm.can_pack16(kind, 16) for kind in kinds):
        sys.exit(f"this CPU (best instruction set {blockmm.best_isa()}) lays out none of {', '.join(sorted(kinds))}")
    widths = tuple(int(w) for w in args.widths.split(","))
    model = load_model(args.target, backend="blocks")
    linears = [m for m in model.model.modules() if isinstance(m, BlockLinear) and m.kind.name in kinds
               and blockmm.can_pack16(m.kind.name, m.out_features)]
    matrices = [m for m in _matrices(model.model) if m.type.name in kinds and blockmm.can_pack16(m.type.name, m.N)]

    def lay_out(packed: bool) -> None:
        for m in linears:  # in place, both ways; the joined products read the same bytes
            if m.packed != packed:
                blockmm.pack16(m.blocks, m.kind, unpack=not packed)
                m.packed = packed
        for matrix in matrices:
            matrix.packed = packed

    took = {packed: {w: [] for w in widths} for packed in (False, True)}
    for _ in range(args.rounds):
        for packed in (False, True):
            lay_out(packed)
            for w, ms in time_passes(model, args.context, widths, 3).items():
                took[packed][w].append(ms)
    median = {packed: {w: statistics.median(v) for w, v in by.items()} for packed, by in took.items()}
    print(f"{args.target}, {len(linears)} matrices of {', '.join(sorted(kinds))} toggled, {args.rounds} rounds:")
    print("| layout | " + " | ".join(f"w={w}" for w in widths) + " |")
    print("|---|" + "---:|" * len(widths))
    for packed, name in ((False, "file's"), (True, "16 rows at a time")):
        print(f"| {name} | " + " | ".join(f"{median[packed][w]:.1f}" for w in widths) + " |")
    print("| ratio | " + " | ".join(f"{median[True][w] / median[False][w]:.2f}" for w in widths) + " |")


if __name__ == "__main__":
    main()
