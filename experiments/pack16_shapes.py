"""Each matrix shape of a real file multiplied in the file's layout and laid out 16 rows at a time (``blockmm.pack16``),
interleaved round by round in one process: ms per shape (all its matrices) at each width and the ratio, then the
totals. Every type this CPU reads in that layout (all on AVX-512 VNNI, the 32-weight types on AVX2); the 32-weight
types take their one-row path up to 16 rows in the file's layout, as a loaded model's do after
``blockmm.choose_paths``. Each product is one Python call (~15-20 us each), so the small shapes' ratios understate
the kernel's; whole passes: experiments/pack16_ab.py.

    python experiments/pack16_shapes.py --target smollm2-135m --widths 1,2,4,8
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from blockmm_costs import matrices
from verispec import blockmm
from verispec.backends.references import gguf_file


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--widths", default="1,2,4,8")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    for kind in ("Q4_0", "Q4_1", "Q5_0", "Q8_0"):
        blockmm.set_one_row_limit(kind, 16)
    groups: dict = {}
    for name, kind, K, raw in matrices(gguf_file(args.target)):
        if blockmm.can_pack16(kind, raw.shape[0]):
            groups.setdefault((name.split(".")[-2], kind, K, raw.shape[0]), []).append(raw)
    print(f"{args.target}: isa {blockmm.isa()}, {blockmm.default_threads()} threads; ms per shape, file's layout -> "
          f"16 rows at a time (ratio), median of {args.rounds} interleaved rounds")
    total = {w: [0.0, 0.0] for w in widths}
    for (name, kind, K, N), raws in groups.items():
        plain = [blockmm.Matrix(raw, kind, K) for raw in raws]
        packed = []
        for raw in raws:
            copy = raw.clone()
            blockmm.pack16(copy, kind)
            packed.append(blockmm.Matrix(copy, kind, K, packed=True))
        cells = []
        for w in widths:
            x = torch.randn(w, K)
            took: dict[int, list[float]] = {0: [], 1: []}
            for _ in range(args.rounds):
                for which, mats in ((0, plain), (1, packed)):
                    start = time.perf_counter()
                    for m in mats:
                        m(x)
                    took[which].append(time.perf_counter() - start)
            a, b = (statistics.median(took[i]) * 1e3 for i in (0, 1))
            total[w][0] += a
            total[w][1] += b
            cells.append(f"w={w} {a:6.2f} -> {b:6.2f} ({b / a:.2f})")
        print(f"{name:12s} {kind} {K:5d} x {N:6d} x{len(raws):3d}: " + "  ".join(cells), flush=True)
    print("all shapes: " + "  ".join(f"w={w} {a:.1f} -> {b:.1f} ms ({b / a:.2f})" for w, (a, b) in total.items()))


if __name__ == "__main__":
    main()
