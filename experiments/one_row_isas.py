"""One-row products of the block kernel on each instruction set, side by side: random blocks of the 1.5B's shapes
(small enough to stay in the L3 cache), M = 1, the median of 40 calls, every set in turn each round (docs/kernels.md,
"An AMD EPYC Zen 4 again ... the one-row paths").

    python experiments/one_row_isas.py [--isas avx512vnni,vnni256,avx2] [--rounds 3]
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_blockmm import random_blocks  # noqa: E402  (the tests' valid random blocks)

from verispec import blockmm  # noqa: E402

SHAPES = (("Q4_K", 8960, 1536), ("Q4_K", 1536, 8960), ("Q6_K", 1536, 8960))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--isas", default=",".join(name for name in ("avx512vnni", "vnni256", "avx2")
                                               if name in blockmm.isas()))
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    data = {s: (random_blocks(*s), torch.randn(1, s[2]), torch.empty(1, s[1])) for s in SHAPES}
    took: dict = {}
    for _ in range(args.rounds):
        for isa in args.isas.split(","):
            blockmm.set_isa(isa)
            for s in SHAPES:
                raw, x, y = data[s]
                calls = []
                for _ in range(40):
                    start = time.perf_counter()
                    blockmm.matmul(x, raw, s[0], out=y)
                    calls.append(time.perf_counter() - start)
                took.setdefault((isa, s), []).append(statistics.median(calls) * 1e3)
    blockmm.set_isa(blockmm.best_isa())
    print(f"one-row products, {blockmm.default_threads()} threads, ms per round:")
    for (isa, (kind, N, K)), rounds in took.items():
        print(f"  {isa:10s} {kind} {N} x {K}: {' '.join(f'{ms:.3f}' for ms in rounds)}")


if __name__ == "__main__":
    main()
