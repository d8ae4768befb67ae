"""The block kernel's arithmetic rate on single matrices small enough to stay in the L3 cache (random blocks of the
1.5B's shapes), at 1, 4 and 8 rows: GMAC/s, to set beside the instructions' peak (experiments/int_dot_peak.cpp).

    python experiments/blockmm_gmacs.py --wide vnni256
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_blockmm import random_blocks  # noqa: E402  (the tests' valid random blocks)

from verispec import blockmm  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--wide", default=None, help=f"instruction set for 3+ rows, one of {', '.join(blockmm.ISAS)}")
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args()
    if args.wide:
        blockmm.set_wide_isa(args.wide)
    print(f"isa {blockmm.isa()}, {blockmm.wide_isa()} past 2 rows, {blockmm.default_threads()} threads")
    for kind, N, K in (("Q4_K", 8960, 1536), ("Q4_K", 1536, 8960), ("Q6_K", 1536, 8960), ("Q4_K", 2048, 1536)):
        raw = random_blocks(kind, N, K)
        for M in (1, 4, 8):
            x, y = torch.randn(M, K), torch.empty(M, N)
            took = []
            for _ in range(args.rounds):
                start = time.perf_counter()
                blockmm.matmul(x, raw, kind, out=y)
                took.append(time.perf_counter() - start)
            ms = statistics.median(took) * 1e3
            print(f"{kind} {N} x {K}, M = {M}: {ms:.3f} ms, {M * N * K / ms / 1e6:.1f} GMAC/s")


if __name__ == "__main__":
    main()
