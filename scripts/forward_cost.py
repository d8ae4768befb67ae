"""Cost of one target forward over w new tokens after a cached context, per dtype: the verify cost curve that
decides how wide speculation can go. Widths are interleaved per repeat; medians are printed.

    python scripts/forward_cost.py --context 300 --repeats 9
    python scripts/forward_cost.py --dtypes bfloat16 --pack both   # oneDNN-packed weights against plain ones
"""

import argparse
import statistics
import time

import torch

from verispec import load_model
from verispec.cache import new_cache, truncate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--context", type=int, default=300, help="cached tokens before the timed pass (default: 300)")
    ap.add_argument("--widths", default="1,2,4,8,16,32", help="tokens per timed pass (default: 1,2,4,8,16,32)")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--pack", choices=("auto", "off", "both"), default="auto",
                    help="prepacked oneDNN weights (verispec.packing): load_model's default, off, or both side by side")
    args = ap.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    gen = torch.Generator().manual_seed(0)
    packs = {"auto": [None], "off": [False], "both": [False, True]}[args.pack]
    for dtype in args.dtypes.split(","):
        targets = [load_model(args.target, dtype=dtype, pack=pack) for pack in packs]
        vocab = targets[0].vocab_size
        ctx = torch.randint(0, vocab, (1, args.context), generator=gen)
        caches = [new_cache() for _ in targets]
        times = {(i, w): [] for i in range(len(targets)) for w in widths}
        with torch.inference_mode():
            for target, cache in zip(targets, caches):
                target.model(input_ids=ctx, past_key_values=cache, use_cache=True, logits_to_keep=1)
            for r in range(args.repeats + 1):  # the first round warms up
                for w in widths:
                    x = torch.randint(0, vocab, (1, w), generator=gen)
                    for i, (target, cache) in enumerate(zip(targets, caches)):  # interleaved: same noise for each
                        t0 = time.perf_counter()
                        target.model(input_ids=x, past_key_values=cache, use_cache=True)
                        if r:
                            times[i, w].append(time.perf_counter() - t0)
                        truncate(cache, args.context)
        for i, target in enumerate(targets):
            base = statistics.median(times[i, widths[0]])
            cells = ", ".join(f"{w}: {1000 * statistics.median(times[i, w]):.1f} ms "
                              f"({statistics.median(times[i, w]) / base:.2f}x)" for w in widths)
            label = f"{dtype}{' packed' if target.packed_layers else ''}"
            print(f"{label:16} context {args.context}: {cells}", flush=True)


if __name__ == "__main__":
    main()
