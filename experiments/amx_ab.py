"""The block kernel's AMX tiles against its AVX paths on a real file's matrices, one block type at a time, alternated.

The file's matrices of the chosen types are copied into one huge-page buffer each (as the blocks backend holds them),
then multiplied at each width with the tiles on and off in turn (``blockmm.set_amx_rows``), rounds interleaved; the
medians and the rate in GMAC/s are printed. Needs a CPU with AMX-INT8 (an Intel Xeon from Sapphire Rapids on).

    python experiments/amx_ab.py --target qwen2.5-coder-1.5b --kinds Q4_K --widths 4,8,16 --threads 1

With ``--packed`` the copies are laid out 16 rows at a time (``blockmm.pack16``, as the blocks backend lays out the
types ``choose_paths`` keeps so) and both sides read that layout: the AMX tiles where ``blockmm.AMX_PACKED`` has the
type, the AVX side the 16-row tiles.
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
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--kinds", default="Q4_K", help="block types, comma-separated (K types)")
    ap.add_argument("--widths", default="4,8,16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--most", type=int, default=60, help="the first this many matrices of those types")
    ap.add_argument("--wide", default="vnni256", help="the instruction set of the AVX side's 3+ rows")
    ap.add_argument("--packed", action="store_true", help="lay the matrices out 16 rows at a time (pack16) first")
    args = ap.parse_args()
    if not blockmm.amx_usable():
        raise SystemExit("this CPU or OS gives no AMX-INT8 tiles: nothing to compare")
    kinds = args.kinds.split(",")
    mats = []
    for name, kind, K, raw in matrices(gguf_file(args.target)):
        if kind in kinds and len(mats) < args.most:
            buf = blockmm.weight_buffer(raw.numel()).view(raw.shape)
            buf.copy_(raw)
            if args.packed:
                blockmm.pack16(buf, kind)
            mats.append((kind, K, blockmm.Matrix(buf, kind, K, packed=args.packed)))
    blockmm.set_wide_isa(args.wide)
    weights = sum(matrix.blocks.shape[0] * K for _, K, matrix in mats)
    print(f"{args.target}: {len(mats)} matrices ({', '.join(kinds)}), {weights / 1e9:.3f} G weights, "
          f"{args.threads} thread(s), {'16-row layout' if args.packed else 'the file layout'}; AVX side: "
          f"{blockmm.isa()}, {args.wide} past 2 rows")
    blockmm.set_threads(args.threads)
    for M in (int(w) for w in args.widths.split(",")):
        xs = [torch.randn(M, K) for _, K, _ in mats]
        took = {True: [], False: []}
        for _ in range(args.rounds):
            for on in (False, True):
                blockmm.set_amx_rows(1 if on else 0)
                start = time.perf_counter()
                for (_, _, matrix), x in zip(mats, xs):
                    matrix(x)
                took[on].append(time.perf_counter() - start)
        blockmm.set_amx_rows(0)
        amx, avx = (statistics.median(took[on]) for on in (True, False))
        print(f"M = {M:2d}: AMX {amx * 1e3:6.1f} ms ({weights * M / amx / 1e9:5.1f} GMAC/s), "
              f"AVX {avx * 1e3:6.1f} ms ({weights * M / avx / 1e9:5.1f} GMAC/s): {avx / amx:.2f}x")


if __name__ == "__main__":
    main()
