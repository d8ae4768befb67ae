"""What reading hidden states costs a llama.cpp pass (docs/llamacpp.md; issue 34).

    python experiments/llamacpp_callback_cost.py [--weights f16]

Loads the default model's weights three times on the llama.cpp backend and times passes of 1, 2 and 6 tokens at
300 cached tokens, interleaved (median of 30): plain passes; passes that ask for the final normed state alone
(llama.cpp's embeddings output, no callback: what a ``--layers 30`` head and Medusa read); the shipped four-layer
head's layers read as llama.cpp's layer inputs (a second copy, since those stay switched on once asked for), and
through the Python eval callback (a third copy, loaded as on a llama.cpp build without layer inputs).
"""

import argparse
import os
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
    plain = load("smollm2-135m", weights=args.weights, threads=args.threads)
    inputs = load("smollm2-135m", weights=args.weights, threads=args.threads)
    os.environ["VERISPEC_LLAMACPP_LAYER_INPUTS"] = "0"
    callback = load("smollm2-135m", weights=args.weights, threads=args.threads, features=True)
    del os.environ["VERISPEC_LLAMACPP_LAYER_INPUTS"]
    variants = {"plain": (plain, ()), "final state, no callback": (plain, FINAL),
                f"layer inputs, {len(LAYERS)} layers": (inputs, LAYERS),
                "plain beside them": (inputs, ()),
                f"callback, {len(LAYERS)} layers": (callback, LAYERS)}
    caches = {}
    for name, (model, _) in variants.items():
        kv = model.new_kv()
        model.forward(kv, list(range(100, 400)), last_only=True)
        caches[name] = kv
    # every model holds two sequences of 300 (llama.cpp's unified KV buffer: a pass attends over every used cell)
    idle = callback.new_kv()
    callback.forward(idle, list(range(100, 400)), last_only=True)
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
