"""Cost of an eager verify pass with transformers' SDPA (key/value heads repeated per query head) against
``grouped_sdpa`` (verispec.backends.hf.attention: SDPA's own grouped heads), on one loaded model, interleaved per
repeat; medians of a float32 pass over w new tokens after a cached context.

    python experiments/grouped_attention_cost.py --contexts 300,1500 --widths 5,9,17 --repeats 25
"""

import argparse
import statistics
import time

from verispec import load_model
from verispec.backends.hf.attention import GROUPED_SDPA


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="300,1500")
    ap.add_argument("--widths", default="5,9,17")
    ap.add_argument("--repeats", type=int, default=25)
    args = ap.parse_args()
    target = load_model("smollm2-135m", dtype="float32")
    widths = [int(w) for w in args.widths.split(",")]
    new = list(range(1000, 1000 + max(widths)))
    for context in (int(c) for c in args.contexts.split(",")):
        kv = target.new_kv()
        target.forward(kv, [1000 + i % 300 for i in range(context)])
        times: dict[tuple[int, str], list[float]] = {}
        for repeat in range(args.repeats + 1):
            for w in widths:
                for impl in ("sdpa", GROUPED_SDPA):
                    target.model.set_attn_implementation(impl)
                    t0 = time.perf_counter()
                    target.forward(kv, new[:w])
                    seconds = time.perf_counter() - t0
                    kv.truncate(context)
                    if repeat:  # the first round warms up
                        times.setdefault((w, impl), []).append(seconds)
        for w in widths:
            a, b = (statistics.median(times[w, impl]) * 1e3 for impl in ("sdpa", GROUPED_SDPA))
            print(f"context {context}, {w:2d} tokens: transformers' SDPA {a:.1f} ms, grouped {b:.1f} ms ({a / b:.3f}x)")


if __name__ == "__main__":
    main()
