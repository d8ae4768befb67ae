"""The blocks backend's passes with every decoder layer in one native call (``block_stack.NativeStack``) against each
layer's own native call under transformers' model loop (the stack switched off in place), interleaved round by round
in one process: medians of each width's pass after --context cached tokens (``time_passes``). Then where a one-token
pass's time goes with the stack: the layers' native call, the embedding, the rotary tables, the caches' slots, the
final norm and output product, and the rest (docs/kernels.md, "the decoder layers in one native call").

    python experiments/native_stack_ab.py [--target smollm2-135m] [--widths 1,2,4,8] [--rounds 6]
"""

import argparse
import statistics
import time

from verispec import load_model
from verispec.backends import block_stack
from verispec.backends.timing import time_passes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--widths", default="1,2,4,8")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    model = load_model(args.target, backend="blocks", threads=args.threads)
    stack = model.stack
    if stack is None:
        raise SystemExit(f"{args.target}: no native stack on this model (see the load's log)")
    took = {on: {w: [] for w in widths} for on in (False, True)}
    for _ in range(args.rounds):
        for on in (False, True):
            model.stack = stack if on else None
            for w, ms in time_passes(model, args.context, widths, 3).items():
                took[on][w].append(ms)
    model.stack = stack
    print(f"{args.target}, blocks, {len(stack.fronts)} layers, {args.threads} threads, medians of {args.rounds} "
          f"rounds, ms")
    print("| decoder layers | " + " | ".join(f"w={w}" for w in widths) + " |")
    print("|---|" + "---:|" * len(widths))
    for on, name in ((False, "a native call each, transformers' loop"), (True, "one native call (NativeStack)")):
        print(f"| {name} | " + " | ".join(f"{statistics.median(took[on][w]):.2f}" for w in widths) + " |")
    print("| ratio | " + " | ".join(
        f"{statistics.median(took[True][w]) / statistics.median(took[False][w]):.3f}" for w in widths) + " |")

    spent: dict[str, float] = {}

    def timed(key, owner, name):
        fn = getattr(owner, name)

        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[key] = spent.get(key, 0.0) + time.perf_counter() - start
        setattr(owner, name, wrapper)
        return lambda: setattr(owner, name, fn)

    kv = model.new_kv()
    vocab = model.vocab_size
    model.forward(kv, [(7 * i) % vocab for i in range(args.context)], last_only=True)
    undo = [timed("native layers", block_stack._native, "layers"), timed("embedding", stack, "embed"),
            timed("rotary", stack, "rotary"), timed("final norm", stack, "norm"), timed("output product", stack, "head"),
            timed("whole pass", model, "forward")]
    steps = 50 * args.rounds
    try:
        for i in range(steps):
            model.forward(kv, [(11 * i) % vocab])
            kv.truncate(args.context)
    finally:
        for u in undo:
            u()
    total = spent.pop("whole pass")
    print(f"\n{steps} one-token passes with the stack, {1e3 * total / steps:.2f} ms a pass (model.forward):")
    for key, s in spent.items():
        print(f"  {key}: {1e3 * s / steps:.2f} ms")
    print(f"  the rest (the caches' slots, the call's arguments, the backend's Python): "
          f"{1e3 * (total - sum(spent.values())) / steps:.2f} ms")


if __name__ == "__main__":
    main()
