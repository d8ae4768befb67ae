"""In-process A/B of the block kernel's look-ahead (``blockmm.set_lookahead``, docs/kernels.md): between two products
the kernel's worker thread fetches its rows of the matrix that comes next while the calling thread runs the framework
(norms, rotary, attention, Python). One model loaded once; each round takes every setting in turn, passes of each
width after --context cached tokens; medians in ms (the first round dropped). The logits are checked equal first.

    python experiments/lookahead_ab.py --target qwen2.5-coder-1.5b --widths 1,4 --rounds 8 [--kb 0:0,512:0,2048:0]

``--kb OWN:CALLER,...`` names the settings in KB (each worker's own rows : worker 1's fetch of the caller's rows).
"""

import argparse

import verispec.blockmm as blockmm
from pass_settings import prefilled, same_logits, time_settings
from verispec import load_model

SETTINGS = {"off": (0, 0), "own 256 KB": (1 << 18, 0), "own 1 MB": (1 << 20, 0),
            "own 1 MB + caller 512 KB": (1 << 20, 1 << 19)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--widths", default="1,4")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--kb", default=None, help="settings as OWN:CALLER KB pairs, comma-separated (default: the four "
                    "above)")
    args = ap.parse_args()
    chosen = SETTINGS if not args.kb else {
        f"own {own} KB + caller {other} KB": (int(own) << 10, int(other) << 10)
        for own, other in (pair.split(":") for pair in args.kb.split(","))}
    widths = [int(w) for w in args.widths.split(",")]
    model = load_model(args.target, backend="blocks", threads=2)
    default = blockmm.lookahead()
    print("kernel:", model.linear_kernel, "| lookahead at load:", default)
    settings = {name: (lambda own=own, other=other: blockmm.set_lookahead(own, other))
                for name, (own, other) in chosen.items()}
    kv = prefilled(model, args.context)
    print("the same logits in every setting:", same_logits(model, kv, args.context, settings, [5, 17, 99, 1000]))
    took = time_settings(model, kv, args.context, settings, widths, args.rounds)
    blockmm.set_lookahead(*default)
    for (setting, w), ms in took.items():
        print(f"  {setting:26s} w={w}: {ms:.1f} ms")


if __name__ == "__main__":
    main()
