"""Inside real one-token passes of the blocks backend: the kernel's milliseconds and the rest's, per prefetch distance
(docs/kernels.md, "On an Intel Sapphire Rapids ... 2026-12-04"). One model loaded once; after 256 cached tokens, each
round runs 3 passes at each distance in turn, the kernel's calls timed by a wrapper around the native entry point;
medians over the rounds. A distance the kernel alone streams fastest can still be slower inside a pass (the weights'
stream evicts the framework's working set), which is what this separates.

    python experiments/pass_split.py --target qwen2.5-coder-1.5b --distances 4096,2048,1024,0 --rounds 8
"""

import argparse
import statistics
import time

from verispec import blockmm, load_model
from verispec.blockmm import _native


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--distances", default="4096,2048,1024,0")
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args()
    distances = [int(d) for d in args.distances.split(",")]
    model = load_model(args.target, backend="blocks", threads=2)
    kv = model.new_kv()
    model.forward(kv, [(7 * i) % 1000 for i in range(256)], last_only=True)
    native, spent = _native.matmul, [0.0]

    def timed(*a):
        start = time.perf_counter()
        out = native(*a)
        spent[0] += time.perf_counter() - start
        return out

    took: dict[int, list] = {d: [] for d in distances}
    token = 100
    _native.matmul = timed
    try:
        for r in range(args.rounds + 1):
            for d in distances:
                blockmm.set_prefetch(d)
                for _ in range(3):
                    spent[0] = 0.0
                    start = time.perf_counter()
                    model.forward(kv, [token], last_only=True)
                    token += 1
                    if r:
                        took[d].append((time.perf_counter() - start, spent[0]))
    finally:
        _native.matmul = native
    print(f"{args.target}, blocks, one token after 256+ cached, 2 threads; medians of {args.rounds} rounds x 3 passes")
    print("| prefetch | pass ms | kernel ms | rest ms |")
    print("|---:|---:|---:|---:|")
    for d, runs in took.items():
        whole, kernel = statistics.median(a for a, _ in runs) * 1e3, statistics.median(b for _, b in runs) * 1e3
        print(f"| {f'{d} B' if d else 'off'} | {whole:.1f} | {kernel:.1f} | {whole - kernel:.1f} |")


if __name__ == "__main__":
    main()
