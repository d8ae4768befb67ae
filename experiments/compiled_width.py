"""AOTInductor programs of the default model at chosen pass widths against the eager pass: the experiments behind
docs/kernels.md's notes on compiled verify passes (a static 8-token program; the dynamic verify program; bfloat16).

    python experiments/compiled_width.py 8                            # one program of static width 8 (2026-11-25)
    python experiments/compiled_width.py 2-16 --example 8 --time 2,5,8,9,12,16   # one program, width dynamic in 2-16
    python experiments/compiled_width.py 1,2,9 --dtype bfloat16       # bfloat16 programs of static widths 1, 2 and 9
    python experiments/compiled_width.py 1,2,9 --dtype bfloat16 --no-autotune   # the same on oneDNN's packed linears
    python experiments/compiled_width.py 1,1-12 --attention grouped-rows --time 1,2,5,12 --context 300,1500 --stored-step
                                    # one dynamic program from width 1 against one-token programs (and the stored step)

Each program (a static width N, or LO-HI: the width dynamic, exported at ``--example``) is compiled with the
compiled step's options into --out (about 1 GB each for float32), its attention transformers' SDPA (copied key/value
heads) or, with ``--attention grouped-rows``, the query heads of a key/value head laid out as a fifth dimension (no
copies; what exports with a dynamic width from 1). Prints each compile time; per context and timed width (default:
the widths named) the largest logit difference from the eager pass and the median ms of every program that runs
that width and of the eager pass, interleaved; and, where a program runs one-token passes, how far the widest timed
pass's rows are from one-token passes over the same tokens (0 = width-invariant).
"""
import argparse
import statistics
import time
import warnings
from pathlib import Path

import torch
from torch._inductor import select_algorithm

import verispec
from verispec.backends.torch_cpu import compile_store
from verispec.backends.hf.compiled import FixedKV, _export, unpacked_copy

GROUPED_ROWS = "verispec_experiment_grouped_rows"


def grouped_rows(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """SDPA with the query heads of each key/value head as a fifth dimension: keys and values broadcast, not copied."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if attention_mask is None:  # the export's layout pass
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, dropout=dropout,
                                              scaling=scaling, **kwargs)
    b, h, rows, d = query.shape
    kv_heads = key.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(
        query.reshape(b, kv_heads, h // kv_heads, rows, d), key[:, :, None], value[:, :, None],
        attn_mask=attention_mask[:, :, None, :, : key.shape[2]], scale=scaling)
    return out.reshape(b, h, rows, d).transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(GROUPED_ROWS, grouped_rows)
    AttentionMaskInterface.register(GROUPED_ROWS, sdpa_mask)


_register()

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("programs", help="comma-separated: N (a static width) or LO-HI (the width dynamic)")
ap.add_argument("--example", type=int, default=4, help="the width a dynamic program is exported at (default 4)")
ap.add_argument("--time", help="widths to time (default: the static widths and each range's ends)")
ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
ap.add_argument("--attention", default="sdpa", choices=["sdpa", "grouped-rows"])
ap.add_argument("--context", default="300", help="cached tokens before the timed passes, comma-separated")
ap.add_argument("--reuse", action="store_true", help="load the packages --out already holds instead of compiling")
ap.add_argument("--stored-step", action="store_true",
                help="time the default model's stored compiled one-token step at width 1 too (verispec compile)")
ap.add_argument("--no-autotune", action="store_true",
                help="compile with inductor's default kernel choices (oneDNN's packed linears) instead of autotuning")
ap.add_argument("--out", default="compiled-width", help="folder for the packages (about 1 GB each)")
args = ap.parse_args()
dtype = getattr(torch, args.dtype)
programs = [tuple(int(x) for x in p.split("-")) if "-" in p else (int(p), int(p)) for p in args.programs.split(",")]
timed = ([int(w) for w in args.time.split(",")] if args.time else sorted({w for lo, hi in programs for w in (lo, hi)}))
m = verispec.load_model("smollm2-135m", dtype=args.dtype)
shadow = unpacked_copy(m.model)
shadow.set_attn_implementation("sdpa" if args.attention == "sdpa" else GROUPED_ROWS)
config = shadow.config
select_algorithm.PRINT_AUTOTUNE = False
Path(args.out).mkdir(exist_ok=True)
runners = {}
for lo, hi in programs:
    t = time.time()
    tuned = "-untuned" if args.no_autotune else ""
    path = str(Path(args.out) / f"w{lo}-{hi}-{args.dtype}-{args.attention}{tuned}.pt2")
    if not (args.reuse and Path(path).exists()):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ep = _export(shadow, lo) if lo == hi else _export(shadow, widths=(lo, hi), example=args.example)
            torch._inductor.aoti_compile_and_package(ep, package_path=path,
                                                     inductor_configs={**compile_store.OPTIONS,
                                                                       "max_autotune": not args.no_autotune})
        print(f"compiled widths {lo}-{hi} in {time.time() - t:.1f} s", flush=True)
    runners[lo, hi] = torch._inductor.aoti_load_package(path)
stored = None
if args.stored_step:
    stored = verispec.load_model("smollm2-135m", compiled="auto").step
    if stored is None:
        raise SystemExit("no stored step for the default model: run `verispec compile` first")

for context in (int(c) for c in args.context.split(",")):
    ids = [(7 * i) % 49000 + 10 for i in range(context)]
    with torch.inference_mode():
        kv, kv2 = FixedKV(), FixedKV()
        m.forward(kv, ids, last_only=True)
        m.forward(kv2, ids, last_only=True)

        def compiled(runner, toks):
            w = len(toks)
            kv.reserve(w)
            L = kv.cache.layers
            out = runner(torch.tensor([toks]), torch.arange(kv.length, kv.length + w)[None],
                         kv.mask(w, dtype, torch.device("cpu"), config), torch.tensor(kv.length),
                         [l.keys for l in L], [l.values for l in L])
            return out[0][0]

        def covering(w):
            found = [(f"{lo}-{hi}", r) for (lo, hi), r in runners.items() if lo <= w <= hi]
            if stored is not None and w == 1:  # the stored step runs through its own wrapper: same inputs
                found.append(("stored step", lambda *a: stored._runner(*a)))
            return found

        ts = {}
        for w in timed:
            toks = list(range(100, 100 + w))
            e = m.forward(kv2, toks).logits
            kv2.truncate(context)
            for name, runner in covering(w):
                a = compiled(runner, toks)
                print(f"{context} cached, width {w}, program {name}: max diff vs eager "
                      f"{(a.float() - e.float()).abs().max().item():.3g}")
        for r in range(15):
            for w in timed:
                toks = list(range(100, 100 + w))
                for name, runner in covering(w):
                    t0 = time.perf_counter(); compiled(runner, toks)
                    ts.setdefault((w, name), []).append(time.perf_counter() - t0)
                t0 = time.perf_counter(); m.forward(kv2, toks)
                ts.setdefault((w, "eager"), []).append(time.perf_counter() - t0)
                kv2.truncate(context)
        for (w, name), v in ts.items():
            print(f"{context} cached, width {w}: {name} {statistics.median(v) * 1000:.1f} ms ({args.dtype})")
        one = [r for (lo, hi), r in runners.items() if lo == 1]
        if one and max(timed) > 1:
            toks = list(range(200, 200 + max(timed)))
            wide = compiled(next(r for (lo, hi), r in runners.items() if lo <= len(toks) <= hi), toks)
            rows = []
            for tok in toks:
                rows.append(compiled(one[0], [tok])[-1])
                kv.length += 1
            kv.length = context
            diff = (wide.float() - torch.stack(rows).float()).abs().max().item()
            print(f"{context} cached: a {len(toks)}-token pass against {len(toks)} one-token passes: "
                  f"max diff {diff:.3g}")
