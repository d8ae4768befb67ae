"""What a token-tree pass costs against a chain pass of the same width on the eager transformers path (the default
model, float32, 300 cached tokens): each shape timed 12 times, interleaved, medians printed.

    python scripts/tree_pass_cost.py
"""

import statistics
import time

import torch

from verispec.backends import load_model

SHAPES = {  # name: (tokens fed, parents of the tree nodes among them, or None for a chain)
    "chain 11": (11, None),
    "tree chain-shaped 1+10": (11, list(range(-1, 9))),
    "tree 1+10 wide": (11, [-1, -1, -1, -1, 0, 0, 1, 1, 4, 6]),
    "chain 5": (5, None),
    "tree 1+4": (5, [-1, -1, 0, 2]),
}


def main() -> None:
    torch.set_num_threads(2)
    target = load_model("smollm2-135m", threads=2)
    kv = target.new_kv(trees=True)
    with torch.inference_mode():
        target.forward(kv, list(range(1000, 1300)), last_only=True)
        past = len(kv)

        def run(n: int, parents) -> float:
            t0 = time.perf_counter()
            target.forward(kv, list(range(2000, 2000 + n)), parents=parents)
            seconds = time.perf_counter() - t0
            kv.truncate(past)
            return seconds

        for _ in range(3):  # warm-up
            for n, parents in SHAPES.values():
                run(n, parents)
        times = {name: [] for name in SHAPES}
        for _ in range(12):
            for name, (n, parents) in SHAPES.items():
                times[name].append(run(n, parents))
    print(target.kernel)
    for name, values in times.items():
        print(f"{name}: {1e3 * statistics.median(values):.1f} ms")


if __name__ == "__main__":
    main()
