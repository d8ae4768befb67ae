"""Single products streamed from memory (not L3-resident): many copies of one random matrix, multiplied one after
another at each width, in the file's layout (the one-row paths and tiles otherwise chosen) and laid out 16 rows at a
time (``blockmm.pack16``), the two taken in turn each round; the best of 5 rounds, ms a product and GB/s of its bytes
(docs/kernels.md, "2026-12-06 evening"). ``blockmm.set_packed_prefetch`` first to compare prefetch distances
(experiments/packed_prefetch_ab.py does so on whole passes). AVX-512 VNNI CPUs only.

    python experiments/packed_stream.py [--kinds Q6_K,Q4_K] [--widths 1,2,4,8] [--megabytes 450]
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_blockmm import random_blocks  # noqa: E402  (the tests' valid random blocks)

from verispec import blockmm  # noqa: E402

SHAPES = {"Q6_K": (1536, 8960), "Q4_K": (8960, 1536), "Q5_0": (4864, 896), "Q8_0": (16384, 896)}  # the 1.5B's, 0.5B's


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kinds", default="Q6_K,Q4_K")
    ap.add_argument("--widths", default="1,2,4,8")
    ap.add_argument("--megabytes", type=float, default=450, help="the copies' bytes a layout (well past the L3)")
    args = ap.parse_args()
    if blockmm.best_isa() != "avx512vnni":
        sys.exit(f"the 16-row layout is read by AVX-512 VNNI code; this CPU's best set is {blockmm.best_isa()}")
    blockmm.set_wide_isa("vnni256")
    blockmm.set_narrow_isa("vnni256")
    for kind in args.kinds.split(","):
        N, K = SHAPES[kind]
        base = random_blocks(kind, N, K, seed=1)
        copies = max(4, int(args.megabytes * 1e6 / base.numel()))
        files, packs = [], []
        for _ in range(copies):
            files.append(blockmm.Matrix(base.clone(), kind, K))
            laid = base.clone()
            blockmm.pack16(laid, kind)
            packs.append(blockmm.Matrix(laid, kind, K, packed=True))
        print(f"{kind} {N} x {K}, {copies} copies of {base.numel() / 1e6:.1f} MB")
        for M in (int(w) for w in args.widths.split(",")):
            x, best = torch.randn(M, K), {}
            for _ in range(5):
                for name, matrices in (("file's layout", files), ("16 rows at a time", packs)):
                    if kind in blockmm.K_TYPES:  # the file's layout on the paths without tiles, as at load
                        blockmm.set_wide16(0 if name == "file's layout" else 2, kind)
                    start = time.perf_counter()
                    for m in matrices:
                        m(x)
                    ms = (time.perf_counter() - start) / copies * 1e3
                    best[name] = min(best.get(name, ms), ms)
            print(f"  {M:3d} rows: " + ", ".join(f"{name} {ms:.3f} ms ({base.numel() / ms / 1e6:.1f} GB/s)"
                                                  for name, ms in best.items()))
        if kind in blockmm.K_TYPES:
            blockmm.set_wide16(0, kind)


if __name__ == "__main__":
    main()
