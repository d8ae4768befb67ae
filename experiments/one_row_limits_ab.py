"""Whole passes of the blocks backend under each combination of the K types' one-row limits (docs/kernels.md, "the
one-row paths timed at the distance kept"): one model loaded once, after 256 cached tokens, the settings taken in
turn each round (2 passes each at every width), medians in ms over the rounds (the first dropped). Which limits the
load kept is printed first.

    python experiments/one_row_limits_ab.py --target qwen2.5-coder-1.5b --widths 1,2 --rounds 10
"""

import argparse
import itertools
import statistics
import time

from verispec import blockmm, load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--widths", default="1,2")
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    model = load_model(args.target, backend="blocks", threads=2)
    kinds = sorted(k for k in model.swapped.kinds if k in blockmm.K_TYPES)
    print("kept at load:", {k: blockmm.one_row_limits()[k] for k in kinds}, "prefetch", blockmm.prefetch())
    kv = model.new_kv()
    model.forward(kv, [(7 * i) % 1000 for i in range(256)], last_only=True)
    settings = list(itertools.product(*[(blockmm.ONE_ROW_MOST[k], 0) for k in kinds]))
    took: dict = {}
    for r in range(args.rounds + 1):
        for setting in settings:
            for kind, limit in zip(kinds, setting):
                blockmm.set_one_row_limit(kind, limit)
            for w in widths:
                for _ in range(2):
                    start = time.perf_counter()
                    model.forward(kv, list(range(100, 100 + w)))
                    if r:
                        took.setdefault((setting, w), []).append((time.perf_counter() - start) * 1e3)
                    kv.truncate(256)
    print(f"| {' / '.join(kinds)} one-row limit | " + " | ".join(f"w={w}" for w in widths) + " |")
    print("|---|" + "---:|" * len(widths))
    for setting in settings:
        cells = " | ".join(f"{statistics.median(took[(setting, w)]):.1f}" for w in widths)
        print(f"| {' / '.join(map(str, setting))} | {cells} |")


if __name__ == "__main__":
    main()
