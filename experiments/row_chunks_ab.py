"""Fixed shares against runs of rows handed out as threads free up (``blockmm.set_row_chunks``), in one process: the
blocks backend's passes of w tokens after 256 cached, the settings alternated pass by pass, medians per width and
setting (docs/kernels.md, "2026-12-07 evening").

    python experiments/row_chunks_ab.py --target qwen2.5-coder-1.5b --widths 1,4,8,16 --settings 0,6 --rounds 12
"""

import argparse
import statistics
import time

from verispec import blockmm, load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--widths", default="1,4,8,16")
    ap.add_argument("--settings", default="0,6", help="row chunks a thread to alternate (0: fixed shares)")
    ap.add_argument("--rounds", type=int, default=12)
    args = ap.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    settings = [int(s) for s in args.settings.split(",")]
    model = load_model(args.target, backend="blocks")
    kv = model.new_kv()
    model.forward(kv, list(range(1000, 1256)))
    base = len(kv)
    times = {(w, s): [] for w in widths for s in settings}
    for r in range(args.rounds + 1):
        for w in widths:
            for s in settings if r % 2 else settings[::-1]:
                blockmm.set_row_chunks(s)
                started = time.perf_counter()
                model.forward(kv, list(range(2000, 2000 + w)))
                if r:  # the first round warms up
                    times[w, s].append((time.perf_counter() - started) * 1e3)
                kv.truncate(base)
    print(f"{args.target}: isa {blockmm.isa()}, {blockmm.default_threads()} threads; median ms of {args.rounds} passes "
          "(ratio to the first setting)")
    print("| w | " + " | ".join(f"chunks {s}" for s in settings) + " |")
    print("|---:|" + "---:|" * len(settings))
    for w in widths:
        first = statistics.median(times[w, settings[0]])
        print(f"| {w} | " + " | ".join(f"{statistics.median(times[w, s]):.1f} ({statistics.median(times[w, s]) / first:.3f})"
                                       for s in settings) + " |")


if __name__ == "__main__":
    main()
