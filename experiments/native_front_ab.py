"""In-process A/B of the blocks backend's native layer front (``verispec.backends.block_step``: a decoder layer's
attention half and gate / up products in one native call) against the lean forward's Python steps (docs/kernels.md).
One model loaded once; each round times passes of each width after --context cached tokens with the fronts on, then
off (or the other way round, alternating), the first round dropped; medians in ms. The logits of both are checked
equal first, at every width.

    python experiments/native_front_ab.py --target qwen2.5-coder-1.5b --widths 1,2,4,8,16 --rounds 6
"""

import argparse
import statistics
import time

import torch

from verispec import load_model
from verispec.backends.hf.layers import decoder_layers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--widths", default="1,2,4,8,16")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--context", type=int, default=256)
    args = ap.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    model = load_model(args.target, backend="blocks", threads=2)
    leans = [layer.__dict__.get("forward") for layer in decoder_layers(model.model)]
    fronts = [getattr(lean, "front", None) for lean in leans]
    print(f"{sum(f is not None for f in fronts)} of {len(leans)} layers have a native front")
    kv = model.new_kv()
    model.forward(kv, [(7 * i) % 1000 for i in range(args.context)], last_only=True)

    def use(on: bool) -> None:
        for lean, front in zip(leans, fronts):
            if lean is not None:
                lean.front = front if on else None

    def run(width: int) -> torch.Tensor:
        out = model.forward(kv, [(11 * i + 5) % 1000 for i in range(width)])
        kv.truncate(args.context)
        return out.logits

    for width in widths:
        got = []
        for on in (True, False):
            use(on)
            got.append(run(width))
        print(f"w={width}: logits equal: {torch.equal(got[0], got[1])}")
    times = {(w, on): [] for w in widths for on in (True, False)}
    for r in range(args.rounds + 1):
        for on in ((True, False) if r % 2 else (False, True)):
            use(on)
            for width in widths:
                took = []
                for _ in range(args.passes):
                    start = time.perf_counter()
                    run(width)
                    took.append(time.perf_counter() - start)
                if r:
                    times[width, on].append(statistics.median(took))
    use(True)
    for width in widths:
        on, off = (1000 * statistics.median(times[width, s]) for s in (True, False))
        print(f"w={width}: native front {on:.1f} ms, lean forward {off:.1f} ms ({on / off:.2f}x)")


if __name__ == "__main__":
    main()
