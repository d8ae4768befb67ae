"""What a token-tree pass costs against a chain pass of the same width on the transformers path (the default model,
float32, 300 cached tokens): each shape timed 12 times, interleaved, medians printed; eagerly, and with
``--compiled`` on the compiled target too (the stored one-token step and verify program, which trees of 2-12 tokens
run since 2026-11-27), both loads in one process, interleaved.

    python experiments/tree_pass_cost.py [--compiled]
"""

import argparse
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
    "step 1": (1, None),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compiled", action="store_true", help="time the compiled target beside the eager one")
    args = parser.parse_args()
    torch.set_num_threads(2)
    targets = {"eager": load_model("smollm2-135m", threads=2)}
    if args.compiled:
        targets["compiled"] = load_model("smollm2-135m", threads=2, compiled="on")
        targets["compiled"].wait_compiled()
    runs = {}
    with torch.inference_mode():
        for kind, target in targets.items():
            kv = target.new_kv(trees=True)
            target.forward(kv, list(range(1000, 1300)), last_only=True)
            runs[kind] = (target, kv, len(kv))

        def run(kind: str, n: int, parents) -> float:
            target, kv, past = runs[kind]
            t0 = time.perf_counter()
            target.forward(kv, list(range(2000, 2000 + n)), parents=parents)
            seconds = time.perf_counter() - t0
            kv.truncate(past)
            return seconds

        for _ in range(3):  # warm-up
            for kind in runs:
                for n, parents in SHAPES.values():
                    run(kind, n, parents)
        times = {(kind, name): [] for kind in runs for name in SHAPES}
        for _ in range(12):
            for name, (n, parents) in SHAPES.items():
                for kind in runs:
                    times[kind, name].append(run(kind, n, parents))
    for kind, (target, _, _) in runs.items():
        print(f"{kind}: {target.kernel}")
    for name in SHAPES:
        print(f"{name}: " + ", ".join(f"{kind} {1e3 * statistics.median(times[kind, name]):.1f} ms" for kind in runs))


if __name__ == "__main__":
    main()
