"""How far ahead the block kernel's one-row paths should request the weights (docs/kernels.md, "On a slower AMD EPYC
Zen 3"). Every matrix a decoding pass multiplies is run at each width under each prefetch distance, the distances
interleaved within each round (the first round dropped), medians in ms.

    python experiments/prefetch_distance.py --target qwen2.5-coder-1.5b --distances 0,1024,4096,16384 --widths 1,2,8
"""

import argparse
import statistics
import time

import torch

from blockmm_costs import matrices  # experiments/ is the script's directory, so this imports the sibling script
from verispec import blockmm
from verispec.backends.references import gguf_file


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--distances", default="0,256,512,1024,2048,4096", help="bytes ahead, comma-separated")
    ap.add_argument("--widths", default="1,2,8")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    mats = [blockmm.Matrix(raw, kind, K) for _, kind, K, raw in matrices(gguf_file(args.target))]
    blockmm.set_threads(args.threads)
    distances = [int(d) for d in args.distances.split(",")]
    for rows in (int(w) for w in args.widths.split(",")):
        xs = {m.K: torch.randn(rows, m.K) for m in mats}
        took: dict[int, list[float]] = {d: [] for d in distances}
        for r in range(args.rounds + 1):
            for d in distances:
                blockmm.set_prefetch(d)
                t0 = time.perf_counter()
                for m in mats:
                    m(xs[m.K])
                if r:
                    took[d].append(1e3 * (time.perf_counter() - t0))
        print(f"{rows} rows: " + "  ".join(f"{d} B {statistics.median(v):.1f} ms" for d, v in took.items()), flush=True)


if __name__ == "__main__":
    main()
