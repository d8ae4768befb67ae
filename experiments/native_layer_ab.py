"""The blocks backend's decoder layers with the MLP's rest (SiLU(gate) * up, down_proj, the residual) inside the
layer's native call against the same in torch (``NativeFront.back`` toggled in place on every layer), interleaved
round by round in one process: medians of each width's pass after --context cached tokens (``time_passes``). Then
where a one-token pass's time goes around the native calls: the calls themselves, ``NativeFront``'s Python,
``LeanForward``'s, and the rest of the pass (embedding, final norm, output layer, transformers' loop), by wrappers
timing each (docs/kernels.md, "2026-12-06 evening").

    python experiments/native_layer_ab.py [--target qwen2.5-coder-1.5b] [--widths 1,2,4,8,16] [--rounds 4]
"""

import argparse
import statistics
import time

from verispec import load_model
from verispec.backends import block_layers, block_step
from verispec.backends.timing import time_passes
from verispec.blockmm import _native


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--widths", default="1,2,4,8,16")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--context", type=int, default=256)
    args = ap.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    model = load_model(args.target, backend="blocks", threads=2)
    fronts = [m.__dict__["forward"].front for m in model.model.modules()
              if isinstance(m.__dict__.get("forward"), block_layers.LeanForward)]
    fronts = [f for f in fronts if f is not None]
    if not fronts or not all(f.back for f in fronts):
        raise SystemExit(f"{args.target}: {sum(f.back for f in fronts)} of {len(fronts)} native layers run their MLP")
    took = {back: {w: [] for w in widths} for back in (False, True)}
    for _ in range(args.rounds):
        for back in (False, True):
            for front in fronts:
                front.back = back
            for w, ms in time_passes(model, args.context, widths, 3).items():
                took[back][w].append(ms)
    print(f"{args.target}, blocks, {len(fronts)} layers, medians of {args.rounds} rounds, ms")
    print("| the MLP's rest | " + " | ".join(f"w={w}" for w in widths) + " |")
    print("|---|" + "---:|" * len(widths))
    for back, name in ((False, "in torch"), (True, "in the native call")):
        print(f"| {name} | " + " | ".join(f"{statistics.median(took[back][w]):.1f}" for w in widths) + " |")

    spent = {"native": 0.0, "front": 0.0, "lean": 0.0}

    def timed(key, fn):
        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[key] += time.perf_counter() - start
        return wrapper

    layer_front, front_call, lean_call = _native.layer_front, block_step.NativeFront.__call__, \
        block_layers.LeanForward.__call__
    _native.layer_front = timed("native", layer_front)
    block_step.NativeFront.__call__ = timed("front", front_call)
    block_layers.LeanForward.__call__ = timed("lean", lean_call)
    try:
        kv = model.new_kv()
        model.forward(kv, [(7 * i) % model.vocab_size for i in range(args.context)], last_only=True)
        rows = []
        for r in range(30):
            spent.update(native=0.0, front=0.0, lean=0.0)
            start = time.perf_counter()
            model.forward(kv, [100 + r])
            kv.truncate(args.context)
            rows.append((time.perf_counter() - start, dict(spent)))
    finally:
        _native.layer_front, block_step.NativeFront.__call__ = layer_front, front_call
        block_layers.LeanForward.__call__ = lean_call
    rows = rows[5:]
    whole = statistics.median(a for a, _ in rows) * 1e3
    part = {k: statistics.median(b[k] for _, b in rows) * 1e3 for k in spent}
    print(f"one-token pass {whole:.2f} ms: native layer calls {part['native']:.2f}, NativeFront's Python "
          f"{part['front'] - part['native']:.2f}, LeanForward's {part['lean'] - part['front']:.2f}, the rest of the "
          f"pass {whole - part['lean']:.2f} (medians of 25, wrappers included)")


if __name__ == "__main__":
    main()
