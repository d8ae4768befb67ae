"""The blocks backend's row attention (``blockmm.attend``) alone, per layer of the 1.5B's shape (12 query heads on 2
KV heads of 128): µs a call for R query rows over L cached keys, median of 100 calls, and x28 for a pass
(docs/kernels.md, "On a faster AMD EPYC Zen 3"). Run it on two builds of the kernel, in turn, to compare them.

    python experiments/attention_cost.py --rows 1,8 --keys 257,1024 --threads 2
"""

import argparse
import statistics
import time

import torch

from verispec import blockmm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--keys", default="257,1024")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--dim", type=int, default=128)
    args = ap.parse_args()
    blockmm.set_threads(args.threads)
    for rows in (int(r) for r in args.rows.split(",")):
        for keys in (int(k) for k in args.keys.split(",")):
            q = torch.randn(1, args.heads, rows, args.dim)
            k = torch.randn(1, args.kv_heads, 2 * keys, args.dim)[:, :, :keys]  # a view of a longer buffer, as a cache
            v = torch.randn(1, args.kv_heads, 2 * keys, args.dim)[:, :, :keys]
            counts = torch.arange(keys - rows + 1, keys + 1, dtype=torch.int32)[None]
            for _ in range(20):
                blockmm.attend_unchecked(q, k, v, counts, None, None)
            times = []
            for _ in range(100):
                start = time.perf_counter()
                blockmm.attend_unchecked(q, k, v, counts, None, None)
                times.append(time.perf_counter() - start)
            took = statistics.median(times)
            print(f"R={rows} L={keys}: {took * 1e6:.1f} us a layer, x28 = {took * 28e3:.1f} ms a pass")


if __name__ == "__main__":
    main()
