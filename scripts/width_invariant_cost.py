"""What width-invariant bfloat16 passes cost (verispec.backends.hf.invariant; docs/kernels.md): median ms of one pass
of 1 / 2 / 4 / 9 / 17 tokens after C cached ones, float32 with SDPA, bfloat16 with SDPA, bfloat16 width-invariant,
interleaved per repeat.

    python scripts/width_invariant_cost.py --context 300,1000 --repeats 9
"""

import argparse
import time

import torch

from verispec.backends import load_model
from verispec.backends.hf.cpu import cpu_info
from verispec.backends.hf.invariant import WIDTH_INVARIANT_ATTENTION
from verispec.backends.hf.packing import PackedLinear

WIDTHS = (1, 2, 4, 9, 17)


def switch(model, invariant: bool) -> None:
    model.model.set_attn_implementation(WIDTH_INVARIANT_ATTENTION if invariant else "sdpa")
    for module in model.model.modules():
        if isinstance(module, PackedLinear):
            module.one_row_as_two = invariant


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", default="300,1000")
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    print(f"CPU {cpu_info()['model']} {cpu_info()['flags']}")
    bf16 = load_model("smollm2-135m", dtype="bfloat16")
    if not bf16.width_invariant:
        raise SystemExit("this CPU keeps SDPA for bfloat16 (no packed bfloat16 kernel, or the probe failed)")
    fp32 = load_model("smollm2-135m")
    configs = {"float32, SDPA": (fp32, False), "bfloat16, SDPA": (bf16, False), "bfloat16, width-invariant": (bf16, True)}
    following = list(range(2000, 2000 + max(WIDTHS)))
    for context in (int(c) for c in args.context.split(",")):
        caches = {}
        for name, (model, _) in configs.items():
            caches[name] = model.new_kv()
            model.forward(caches[name], list(range(1000, 1000 + context)), last_only=True)
        times = {name: {w: [] for w in WIDTHS} for name in configs}
        for _ in range(args.repeats):
            for name, (model, invariant) in configs.items():
                switch(model, invariant) if model is bf16 else None
                for width in WIDTHS:
                    t0 = time.perf_counter()
                    model.forward(caches[name], following[:width])
                    times[name][width].append(time.perf_counter() - t0)
                    caches[name].truncate(context)
        for name, by_width in times.items():
            medians = " / ".join(f"{1e3 * sorted(t)[len(t) // 2]:.1f}" for t in by_width.values())
            print(f"context {context}, {name}: {medians} ms at widths {'/'.join(map(str, WIDTHS))}", flush=True)


if __name__ == "__main__":
    main()
