"""In-process A/B of the block kernel's look-ahead (``blockmm.set_lookahead``, docs/kernels.md): between two products
the kernel's worker thread fetches its rows of the matrix that comes next while the calling thread runs the framework
(norms, rotary, attention, Python). One model loaded once; each round takes every setting in turn, passes of each
width after --context cached tokens; medians in ms (the first round dropped). The logits are checked equal first.

    python experiments/lookahead_ab.py --target qwen2.5-coder-1.5b --widths 1,4 --rounds 8
"""

import argparse
import statistics
import time

import torch

import verispec.blockmm as blockmm
from verispec import load_model

SETTINGS = {"off": (0, 0), "own 256 KB": (1 << 18, 0), "own 1 MB": (1 << 20, 0),
            "own 1 MB + caller 512 KB": (1 << 20, 1 << 19)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--widths", default="1,4")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--context", type=int, default=256)
    args = ap.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    model = load_model(args.target, backend="blocks", threads=2)
    default = blockmm.lookahead()
    print("kernel:", model.linear_kernel, "| lookahead at load:", default)
    kv = model.new_kv()
    model.forward(kv, [(7 * i) % 1000 for i in range(args.context)], last_only=True)
    logits = []
    for own, other in SETTINGS.values():
        blockmm.set_lookahead(own, other)
        logits.append(model.forward(kv, [5, 17, 99, 1000]).logits.clone())
        kv.truncate(args.context)
    print("the same logits in every setting:", all(torch.equal(logits[0], other) for other in logits))
    took = {(s, w): [] for s in SETTINGS for w in widths}
    for r in range(args.rounds + 1):
        for setting, (own, other) in SETTINGS.items():
            blockmm.set_lookahead(own, other)
            for w in widths:
                for _ in range(3):
                    start = time.perf_counter()
                    model.forward(kv, [(11 * i + r) % 1000 for i in range(w)])
                    kv.truncate(args.context)
                    if r:
                        took[(setting, w)].append(1e3 * (time.perf_counter() - start))
    blockmm.set_lookahead(*default)
    for (setting, w), times in took.items():
        print(f"  {setting:26s} w={w}: {statistics.median(times):.1f} ms")


if __name__ == "__main__":
    main()
