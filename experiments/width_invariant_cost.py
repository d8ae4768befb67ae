"""What width-invariant bfloat16 passes cost (verispec.backends.hf.invariant; docs/kernels.md): median ms of one pass
of 1 / 2 / 4 / 9 / 17 tokens after C cached ones, float32 with SDPA, bfloat16 with SDPA, bfloat16 width-invariant,
interleaved per repeat. ``--trees`` measures token-tree passes instead (the pending token and 10 or 16 nodes, EAGLE's
shapes), ``--batches`` batched passes of 4 sequences of C cached tokens each (1 and 4 tokens a sequence).

    python experiments/width_invariant_cost.py --context 300,1000 --repeats 9
    python experiments/width_invariant_cost.py --context 300 --repeats 15 --trees --batches
"""

import argparse
import time

import torch

from verispec.backends import load_model
from verispec.backends.torch_cpu.cpu import cpu_info
from verispec.backends.hf.invariant import WIDTH_INVARIANT_ATTENTION
from verispec.backends.torch_cpu.packing import PackedLinear

WIDTHS = (1, 2, 4, 9, 17)
TREES = {"tree of 10": [-1, -1, -1, 0, 0, 1, 3, 3, 5, 6],
         "tree of 16": [-1, -1, -1, -1, 0, 0, 0, 1, 1, 2, 4, 4, 7, 10, 10, 13]}
BATCH = 4


def switch(model, invariant: bool) -> None:
    model.model.set_attn_implementation(WIDTH_INVARIANT_ATTENTION if invariant else "sdpa")
    for module in model.model.modules():
        if isinstance(module, PackedLinear):
            module.one_row_as_two = invariant


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", default="300,1000")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--trees", action="store_true", help="token-tree passes (pending token + 10 / 16 nodes)")
    ap.add_argument("--batches", action="store_true", help=f"batched passes of {BATCH} sequences, 1 and 4 tokens each")
    args = ap.parse_args()
    print(f"CPU {cpu_info()['model']} {cpu_info()['flags']}")
    bf16 = load_model("smollm2-135m", dtype="bfloat16")
    if not bf16.width_invariant:
        raise SystemExit("this CPU keeps SDPA for bfloat16 (no packed bfloat16 kernel, or the probe failed)")
    fp32 = load_model("smollm2-135m")
    configs = {"float32, SDPA": (fp32, False), "bfloat16, SDPA": (bf16, False), "bfloat16, width-invariant": (bf16, True)}
    following = list(range(2000, 2000 + max(WIDTHS)))
    shapes: dict[str, tuple[str, object]] = {f"{w}": ("chain", w) for w in WIDTHS}
    if args.trees or args.batches:
        shapes = {}
    if args.trees:
        shapes.update({name: ("tree", parents) for name, parents in TREES.items()})
    if args.batches:
        shapes.update({f"batch of {BATCH} x {w}": ("batch", w) for w in (1, 4)})
    for context in (int(c) for c in args.context.split(",")):
        prompt = list(range(1000, 1000 + context))
        caches, groups = {}, {}
        for name, (model, _) in configs.items():
            caches[name] = model.new_kv()
            model.forward(caches[name], prompt, last_only=True)
            if args.batches:
                group = model.new_kv_group(BATCH)
                groups[name] = [group.new_kv() for _ in range(BATCH)]
                model.forward_batch([(kv, prompt[: context - i]) for i, kv in enumerate(groups[name])], last_only=True)
        times = {name: {shape: [] for shape in shapes} for name in configs}
        for _ in range(args.repeats):
            for name, (model, invariant) in configs.items():
                switch(model, invariant) if model is bf16 else None
                for shape, (kind, arg) in shapes.items():
                    t0 = time.perf_counter()
                    if kind == "chain":
                        model.forward(caches[name], following[:arg])
                    elif kind == "tree":
                        model.forward(caches[name], following[: 1 + len(arg)], parents=arg)
                    else:
                        model.forward_batch([(kv, following[:arg]) for kv in groups[name]])
                    times[name][shape].append(time.perf_counter() - t0)
                    caches[name].truncate(context)
                    for i, kv in enumerate(groups.get(name, [])):
                        kv.truncate(context - i)
        for name, by_shape in times.items():
            medians = " / ".join(f"{1e3 * sorted(t)[len(t) // 2]:.1f}" for t in by_shape.values())
            print(f"context {context}, {name}: {medians} ms for {' / '.join(shapes)}", flush=True)

if __name__ == "__main__":
    main()
