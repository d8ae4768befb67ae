"""What reading hidden states costs a llama.cpp pass (docs/llamacpp.md; issue 34).

    python scripts/llamacpp_callback_cost.py [--weights f16]

Loads the default model's weights twice on the llama.cpp backend, without and with ``features=True`` (the Python
eval callback a four-layer EAGLE head reads its layers through), and times passes of 1, 2 and 6 tokens at 300
cached tokens, interleaved (median of 30): plain passes, passes that ask for the final normed state alone
(llama.cpp's embeddings output, no callback: what a ``--layers 30`` head and Medusa read), and passes through the
callback asking for the shipped head's four layers.
"""

import argparse
import statistics
import time

from verispec.backends.llamacpp import load

LAYERS = (2, 15, 28, 30)  # the shipped head's
FINAL = (30,)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", default="f16", help="llama.cpp weight format (default: f16; as-is = the Q4_1 file)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    models = {features: load("smollm2-135m", weights=args.weights, threads=args.threads, features=features)
              for features in (False, True)}
    variants = {"plain": (models[False], ()), "final state, no callback": (models[False], FINAL),
                f"callback, {len(LAYERS)} layers": (models[True], LAYERS)}
    caches = {}
    for name, (model, _) in variants.items():
        kv = model.new_kv()
        model.forward(kv, list(range(100, 400)), last_only=True)
        caches[name] = kv
    for width in (1, 2, 6):
        times = {name: [] for name in variants}
        for _ in range(30):
            for name, (model, layers) in variants.items():
                t0 = time.perf_counter()
                model.forward(caches[name], list(range(500, 500 + width)), feature_layers=layers)
                times[name].append(time.perf_counter() - t0)
                caches[name].truncate(300)
        print(f"{args.weights} width {width}: " + ", ".join(f"{name} {statistics.median(t) * 1e3:.2f} ms"
                                                          for name, t in times.items()), flush=True)


if __name__ == "__main__":
    main()
