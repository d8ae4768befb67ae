"""What the eval callback that returns hidden states costs a llama.cpp pass (docs/llamacpp.md; issue 34).

    python scripts/llamacpp_callback_cost.py

Loads the default model's F16 weights twice on the llama.cpp backend, without and with ``features=True`` (the
Python eval callback EAGLE reads its four layers through), and times passes of 1, 2 and 6 tokens at 300 cached
tokens, the two interleaved (median of 30); the second asks for the EAGLE head's layers on every pass.
"""

import statistics
import time

from verispec.backends.llamacpp import load

LAYERS = (2, 15, 28, 30)  # the shipped head's


def main() -> None:
    models = {features: load("smollm2-135m", weights="f16", threads=2, features=features) for features in (False, True)}
    caches = {}
    for features, model in models.items():
        kv = model.new_kv()
        model.forward(kv, list(range(100, 400)), last_only=True)
        caches[features] = kv
    for width in (1, 2, 6):
        times = {features: [] for features in models}
        for _ in range(30):
            for features, model in models.items():
                t0 = time.perf_counter()
                model.forward(caches[features], list(range(500, 500 + width)), feature_layers=LAYERS if features else ())
                times[features].append(time.perf_counter() - t0)
                caches[features].truncate(300)
        print(f"width {width}: plain {statistics.median(times[False]) * 1e3:.2f} ms, with the callback and "
              f"{len(LAYERS)} layers {statistics.median(times[True]) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
