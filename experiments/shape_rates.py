"""The block kernel's rate per matrix shape of a real file: each shape's matrices multiplied at widths w, GMAC/s and
c(w) / c(1) per shape, so that what a whole pass's curve hides (which shapes and types are slow at which width) shows.

    python experiments/shape_rates.py --target qwen2.5-coder-1.5b --widths 1,8,16

The 32-weight types take their one-row path up to 16 rows, as a loaded model's do after ``blockmm.choose_paths``
(without it they would time the buffered path); the K types keep the kernel's defaults.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch

from blockmm_costs import matrices
from verispec import blockmm
from verispec.backends.references import gguf_file


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--widths", default="1,8,16")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=blockmm.default_threads())
    args = ap.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    for kind in ("Q4_0", "Q4_1", "Q5_0", "Q8_0"):
        blockmm.set_one_row_limit(kind, 16)
    groups = collections.defaultdict(list)
    for name, kind, K, raw in matrices(gguf_file(args.target)):
        groups[name.split(".")[-2], kind, K, raw.shape[0]].append(raw)
    print(f"{args.target}: isa {blockmm.isa()}, {args.threads} threads; ms per shape (all its matrices), GMAC/s, "
          "c(w) / c(1); the first round not counted")
    for (name, kind, K, N), raws in sorted(groups.items(), key=lambda kv: -len(kv[1]) * kv[1][0].numel()):
        xs = {w: torch.randn(w, K) for w in widths}
        ys = {w: torch.empty(w, N) for w in widths}
        took = {w: [] for w in widths}
        for r in range(args.rounds + 1):
            for w in widths:
                t = time.perf_counter()
                for raw in raws:
                    blockmm.matmul(xs[w], raw, kind, threads=args.threads, out=ys[w])
                if r:
                    took[w].append(time.perf_counter() - t)
        ms = {w: statistics.median(took[w]) * 1e3 for w in widths}
        cells = [f"w={w} {ms[w]:6.1f} ms {w * K * N * len(raws) / ms[w] / 1e6:6.1f} GMAC/s ({ms[w] / ms[widths[0]]:.2f})"
                 for w in widths]
        print(f"{name:12s} {kind:5s} {K:5d} x {N:6d} x{len(raws):3d}: " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
