"""Two blocks models in one process (a target and its draft model) share the kernel's process-wide path settings,
which are the last load's choice. This times each model's passes under its own load's settings and under the other's,
in turn in one process (``blockmm.set_path_settings``), to say what running under the other's choice costs.

    python experiments/two_models_paths.py --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --rounds 6
"""

import argparse
import json

import verispec.blockmm as blockmm
from pass_settings import prefilled, time_settings
from verispec import load_model

KINDS = ("Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--widths", default="1,2,4,8,16")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--context", type=int, default=256)
    args = ap.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    models = {}
    for name in (args.target, args.draft):
        model = load_model(name, backend="blocks", threads=2)
        models[name] = (model, blockmm.path_settings(KINDS))  # what this load chose (and left in force)
        print(name, "chose", json.dumps(models[name][1]))
    for name, (model, own) in models.items():
        other = next(s for n, (_, s) in models.items() if n != name)
        settings = {"own": lambda s=own: blockmm.set_path_settings(s),
                    "the other's": lambda s=other: blockmm.set_path_settings(s)}
        kv = prefilled(model, args.context)
        for (setting, w), ms in time_settings(model, kv, args.context, settings, widths, args.rounds).items():
            print(f"  {name} {setting:12s} w={w}: {ms:.1f} ms")


if __name__ == "__main__":
    main()
