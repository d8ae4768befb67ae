"""Cost of one target forward over w new tokens after a cached context, per dtype: the verify cost curve that
decides how wide speculation can go. Widths are interleaved per repeat; medians are printed.

    python experiments/forward_cost.py --context 300 --repeats 9
    python experiments/forward_cost.py --dtypes bfloat16 --pack both   # oneDNN-packed weights against plain ones
    python experiments/forward_cost.py --dtypes float32 --compile both --widths 1,9,17   # the compiled one-token step

Passes run through the backend (``TargetModel.forward``), as the engine runs them: with ``--compile`` one-token
passes take the compiled step and wider ones run eagerly over the same cache.
"""

import argparse
import statistics
import time

import torch

from verispec import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--context", default="300",
                    help="cached tokens before the timed pass; comma-separated for several (default: 300)")
    ap.add_argument("--widths", default="1,2,4,8,16,32", help="tokens per timed pass (default: 1,2,4,8,16,32)")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--pack", choices=("auto", "off", "both"), default="auto",
                    help="prepacked oneDNN weights (verispec.backends.torch_cpu.packing): load_model's default, off, or both side by side")
    ap.add_argument("--compile", choices=("off", "on", "both"), default="off",
                    help="the compiled one-token step (verispec.backends.hf.compiled; float32): off, on, or both side by side")
    args = ap.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    gen = torch.Generator().manual_seed(0)
    packs = {"auto": [None], "off": [False], "both": [False, True]}[args.pack]
    compiles = {"off": [False], "on": [True], "both": [False, True]}[args.compile]
    for dtype in args.dtypes.split(","):
        targets = [load_model(args.target, dtype=dtype, pack=pack, compiled=c) for pack in packs for c in compiles]
        for context in [int(c) for c in args.context.split(",")]:
            measure(targets, context, widths, args.repeats, gen, dtype)


def measure(targets, context: int, widths: list[int], repeats: int, gen: torch.Generator, dtype: str) -> None:
    """Time each width after ``context`` cached tokens on every target, interleaved, and print the medians."""
    vocab = targets[0].vocab_size
    ctx = torch.randint(0, vocab, (context,), generator=gen).tolist()
    caches = [target.new_kv() for target in targets]
    times = {(i, w): [] for i in range(len(targets)) for w in widths}
    with torch.inference_mode():
        for target, cache in zip(targets, caches):
            target.forward(cache, ctx, last_only=True)
        for r in range(repeats + 1):  # the first round warms up
            for w in widths:
                x = torch.randint(0, vocab, (w,), generator=gen).tolist()
                for i, (target, cache) in enumerate(zip(targets, caches)):  # interleaved: same noise for each
                    t0 = time.perf_counter()
                    target.forward(cache, x)
                    if r:
                        times[i, w].append(time.perf_counter() - t0)
                    cache.truncate(context)
    for i, target in enumerate(targets):
        base = statistics.median(times[i, widths[0]])
        cells = ", ".join(f"{w}: {1000 * statistics.median(times[i, w]):.1f} ms "
                          f"({statistics.median(times[i, w]) / base:.2f}x)" for w in widths)
        label = f"{dtype}{' packed' if target.packed_layers else ''}{' compiled' if target.step else ''}"
        print(f"{label:25} context {context}: {cells}", flush=True)


if __name__ == "__main__":
    main()
