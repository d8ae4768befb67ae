"""Cost of one target forward over w new tokens after a cached context, per dtype: the verify cost curve that
decides how wide speculation can go. Widths are interleaved per repeat; medians are printed.

    python scripts/forward_cost.py --context 300 --repeats 9
"""

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

from verispec import load_model
from verispec.cache import truncate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--context", type=int, default=300, help="cached tokens before the timed pass (default: 300)")
    ap.add_argument("--widths", default="1,2,4,8,16,32", help="tokens per timed pass (default: 1,2,4,8,16,32)")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    args = ap.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    gen = torch.Generator().manual_seed(0)
    for dtype in args.dtypes.split(","):
        target = load_model(args.target, dtype=dtype)
        vocab = target.vocab_size
        ctx = torch.randint(0, vocab, (1, args.context), generator=gen)
        cache = DynamicCache()
        times = {w: [] for w in widths}
        with torch.inference_mode():
            target.model(input_ids=ctx, past_key_values=cache, use_cache=True, logits_to_keep=1)
            for r in range(args.repeats + 1):  # the first round warms up
                for w in widths:
                    x = torch.randint(0, vocab, (1, w), generator=gen)
                    t0 = time.perf_counter()
                    target.model(input_ids=x, past_key_values=cache, use_cache=True)
                    if r:
                        times[w].append(time.perf_counter() - t0)
                    truncate(cache, args.context)
        base = statistics.median(times[widths[0]])
        cells = ", ".join(f"{w}: {1000 * statistics.median(times[w]):.1f} ms ({statistics.median(times[w]) / base:.2f}x)"
                          for w in widths)
        print(f"{dtype:9} context {args.context}: {cells}", flush=True)


if __name__ == "__main__":
    main()
