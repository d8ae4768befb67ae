"""In-process A/B of the distance at which the 16-row layout's readers request its blocks into L2
(``blockmm.set_packed_prefetch``, docs/kernels.md): one model loaded once (its matrices laid out as the load chose),
each round takes every distance in turn, passes of each width after --context cached tokens; medians in ms (the first
round dropped). The logits are checked equal first.

    python experiments/packed_prefetch_ab.py --target qwen2.5-coder-1.5b --widths 1,4,8 --rounds 8 [--bytes 8192,2048,0]
"""

import argparse

import verispec.blockmm as blockmm
from pass_settings import prefilled, same_logits, time_settings
from verispec import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--widths", default="1,4,8")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--bytes", default=",".join(str(b) for b in blockmm.PACKED_PREFETCH_CANDIDATES),
                    help="distances in bytes, comma-separated (0: none; default: the ones the load times)")
    args = ap.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    model = load_model(args.target, backend="blocks", threads=2)
    kept = blockmm.packed_prefetch()
    print("kernel:", model.linear_kernel, "| laid out:", blockmm.pack16_kinds() or "none", "| distance at load:", kept)
    settings = {f"{int(b)} B" if int(b) else "none": (lambda b=int(b): blockmm.set_packed_prefetch(b))
                for b in args.bytes.split(",")}
    kv = prefilled(model, args.context)
    print("the same logits at every distance:", same_logits(model, kv, args.context, settings, [5, 17, 99, 1000]))
    took = time_settings(model, kv, args.context, settings, widths, args.rounds)
    blockmm.set_packed_prefetch(kept)
    for (setting, w), ms in took.items():
        print(f"  {setting:8s} w={w}: {ms:.1f} ms")


if __name__ == "__main__":
    main()
