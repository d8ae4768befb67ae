"""Blocks passes with and without a light competing process (a busy loop of --busy-ms every --period-ms, as a
benchmark client beside a server takes a slice of a core), in turn, in one process: how much a pass loses to another
process's CPU time. The kernel splits each product's rows between its threads in fixed shares, so a thread that loses
its core for a moment holds the product up (docs/kernels.md, "2026-12-06 morning"). Medians in ms.

    python experiments/interference_ab.py --target qwen2.5-coder-1.5b --widths 1,4,8 --rounds 4 [--backend llamacpp]
"""

import argparse
import statistics
import subprocess
import sys
import time

from verispec import load_model

BUSY = """
import sys, time
busy, period, end = float(sys.argv[1]), float(sys.argv[2]), time.time() + float(sys.argv[3])
while time.time() < end:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < busy:
        pass
    time.sleep(period - busy)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--backend", default="blocks", help="blocks (default) or llamacpp, for its threadpool beside ours")
    ap.add_argument("--widths", default="1,4")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--passes", type=int, default=15)
    ap.add_argument("--busy-ms", type=float, default=2.0)
    ap.add_argument("--period-ms", type=float, default=40.0)
    ap.add_argument("--context", type=int, default=256)
    args = ap.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    model = load_model(args.target, backend=args.backend, threads=2)
    kv = model.new_kv()
    model.forward(kv, [(7 * i) % 1000 for i in range(args.context)], last_only=True)
    settle = time.time() + 15  # passes run slow for ~20 s after a load (docs/kernels.md)
    while time.time() < settle:
        model.forward(kv, [5])
        kv.truncate(args.context)
    took = {(w, mode): [] for w in widths for mode in ("alone", "beside")}
    for _ in range(args.rounds):
        for mode in ("alone", "beside"):
            other = None
            if mode == "beside":
                other = subprocess.Popen([sys.executable, "-c", BUSY, str(args.busy_ms / 1000),
                                          str(args.period_ms / 1000), "600"])
                time.sleep(0.5)
            try:
                for w in widths:
                    times = []
                    for _ in range(args.passes):
                        start = time.perf_counter()
                        model.forward(kv, [5] * w)
                        times.append(time.perf_counter() - start)
                        kv.truncate(args.context)
                    took[w, mode].append(statistics.median(times))
            finally:
                if other is not None:
                    other.kill()
                    other.wait()
    share = args.busy_ms / args.period_ms
    for w in widths:
        alone, beside = (1000 * statistics.median(took[w, m]) for m in ("alone", "beside"))
        print(f"w={w}: alone {alone:.1f} ms, beside a process busy {share:.0%} of a core {beside:.1f} ms "
              f"({beside / alone:.3f}x)")


if __name__ == "__main__":
    main()
