"""What each way of reading a large buffer gets from memory here, GB/s: torch's sum (the memory floor's only probe
before 2026-12-08), a matrix-vector product (the BLAS library's, which requests its rows ahead), and a dot product of
the buffer with itself (its bytes once); what ``verispec costs`` divides a file's bytes by is the faster of the
first two (``timing.read_bandwidth``).

    python experiments/read_probes.py --threads 2 --rounds 7
"""

import argparse
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gigabytes", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    data = torch.ones(int(args.gigabytes * 2**30) // (4 * 4096) * 4096)
    rows, vector = data.view(-1, 4096), torch.ones(4096)
    reads = {"sum": data.sum, "matrix-vector product": lambda: torch.mv(rows, vector),
             "dot product with itself": lambda: torch.dot(data, data)}
    for name, read in reads.items():
        read()
        best = min((lambda t0: (read(), time.perf_counter() - t0)[1])(time.perf_counter()) for _ in range(args.rounds))
        print(f"{name}: {data.numel() * 4 / best / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
