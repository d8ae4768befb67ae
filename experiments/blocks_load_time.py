"""How long a blocks model takes to load, and how much of it is ``blockmm.choose_paths`` timing the kernel's paths on
the model's own matrices; each model loaded twice in one process. With ``VERISPEC_COST_CACHE=0`` every load times the
paths; with the measurement store on, a load after the first restores the stored choice (docs/kernels.md).

    VERISPEC_COST_CACHE=0 python experiments/blocks_load_time.py smollm2-135m qwen2.5-coder-1.5b
    VERISPEC_COST_CACHE=/tmp/store python experiments/blocks_load_time.py smollm2-135m
"""

import sys
import time

from verispec import load_model
from verispec.backends import blocks


def main() -> None:
    refs = sys.argv[1:] or ["smollm2-135m"]
    took = []
    choose = blocks._choose_paths

    def timed(model):
        t0 = time.perf_counter()
        choose(model)
        took.append(time.perf_counter() - t0)

    blocks._choose_paths = timed
    for ref in refs:
        for _ in range(2):
            t0 = time.perf_counter()
            model = load_model(ref, backend="blocks")
            print(f"{ref}: load {time.perf_counter() - t0:.2f} s, of which choosing the kernel's paths {took[-1]:.2f} s",
                  flush=True)
            del model


if __name__ == "__main__":
    main()
