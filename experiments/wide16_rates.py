"""The 16-row tiles, on the file's layout and on the 16-row one (``blockmm.pack16``), against the paths otherwise
chosen, single products: random blocks of the built-in models' shapes (small enough to stay in the L3 cache), each width in the
three ways in turn each round, the best of --rounds rounds of 10 calls, ms and GMAC/s (docs/kernels.md, "2026-12-06:
the 16-row tiles" and "the 16-row layout"). AVX-512 VNNI CPUs only.

    python experiments/wide16_rates.py [--widths 1,2,3,4,5,6,8,16,64,128] [--off-isa vnni256] [--rounds 5]
        [--kinds Q4_K,Q6_K,Q5_0,Q8_0,Q4_1]
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_blockmm import random_blocks  # noqa: E402  (the tests' valid random blocks)

from verispec import blockmm  # noqa: E402

SHAPES = {  # the 1.5B's K types; the 0.5B's Q5_0 and a slice of its Q8_0 output layer; SmolLM2's Q4_1
    "Q4_K": (8960, 1536), "Q6_K": (1536, 8960), "Q5_0": (4864, 896), "Q8_0": (16384, 896), "Q4_1": (1536, 576)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--widths", default="1,2,3,4,5,6,8,16,64,128")
    ap.add_argument("--off-isa", default="vnni256", help="the set of the products without the tiles")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--kinds", default="Q4_K,Q6_K", help=f"of {', '.join(SHAPES)} (32-weight types: no tiles on the "
                    "file's layout, so two ways)")
    args = ap.parse_args()
    if blockmm.best_isa() != "avx512vnni":
        sys.exit(f"the 16-row tiles are AVX-512 VNNI code; this CPU's best set is {blockmm.best_isa()}")
    blockmm.set_wide_isa(args.off_isa)
    blockmm.set_narrow_isa(args.off_isa)
    for kind in args.kinds.split(","):
        N, K = SHAPES[kind]
        modes = ("packed", "tiles", "off") if kind in blockmm.K_TYPES else ("packed", "off")
        if kind not in blockmm.K_TYPES:  # their one-row path, which the load keeps up to 16 rows where it is faster
            blockmm.set_one_row_limit(kind, blockmm.ONE_ROW_MOST[kind])
        W = random_blocks(kind, N, K, seed=1)
        laid = W.clone()
        blockmm.pack16(laid, kind)
        packed = blockmm.Matrix(laid, kind, K, packed=True)
        print(f"{kind} {N} x {K}")
        for M in (int(w) for w in args.widths.split(",")):
            x, best = torch.randn(M, K), {}
            for _ in range(args.rounds):
                for mode in modes:
                    if kind in blockmm.K_TYPES:
                        blockmm.set_wide16(2 if mode == "tiles" else 0, kind)
                    product = packed if mode == "packed" else lambda x: blockmm.matmul(x, W, kind)
                    product(x)
                    start = time.perf_counter()
                    for _ in range(10):
                        product(x)
                    ms = (time.perf_counter() - start) * 100
                    best[mode] = min(best.get(mode, ms), ms)
            rate = {mode: M * N * K / ms / 1e6 for mode, ms in best.items()}
            tiles = f"16-row tiles {best['tiles']:.3f} ms ({rate['tiles']:.0f} GMAC/s), " if "tiles" in best else ""
            print(f"  {M:4d} rows: 16-row layout {best['packed']:.3f} ms ({rate['packed']:.0f} GMAC/s), {tiles}"
                  f"{args.off_isa} paths {best['off']:.3f} ms ({rate['off']:.0f} GMAC/s)")
        if kind in blockmm.K_TYPES:
            blockmm.set_wide16(0, kind)


if __name__ == "__main__":
    main()
