"""A static-width AOTInductor verify program (width W) against the eager pass of the same width: the experiment behind
docs/kernels.md's note on compiled verify passes. Writes the package to --out (about 1 GB), prints the compile time,
the largest logit difference from eager and the median pass times.

    python scripts/compiled_width.py 8 --out /tmp/w8.pt2
"""
import argparse
import statistics
import time

import torch
from torch._inductor import select_algorithm

import verispec
from verispec.backends.hf import compile_store
from verispec.backends.hf.compiled import FixedKV, _export, unpacked_copy

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("width", type=int)
ap.add_argument("--out", default="compiled-width.pt2", help="where the package goes (about 1 GB)")
W = ap.parse_args().width
path = ap.parse_args().out
m = verispec.load_model("smollm2-135m")
shadow = unpacked_copy(m.model); shadow.set_attn_implementation("sdpa")
config = shadow.config
t = time.time()
ep = _export(shadow, W)
select_algorithm.PRINT_AUTOTUNE = False
torch._inductor.aoti_compile_and_package(ep, package_path=path, inductor_configs=dict(compile_store.OPTIONS))
print("compile", round(time.time() - t, 1))
runner = torch._inductor.aoti_load_package(path)
ids = m.tokenizer("The committee approved the new budget on Monday, and the mayor signed it on Friday. " * 12)["input_ids"][:300]
with torch.inference_mode():
    kv = FixedKV(); m.forward(kv, ids, last_only=True)
    kv2 = FixedKV(); m.forward(kv2, ids, last_only=True)
    toks = list(range(100, 100 + W))
    def compiled():
        L = kv.cache.layers
        out = runner(torch.tensor([toks]), torch.arange(kv.length, kv.length + W)[None], kv.mask(W, torch.float32, torch.device("cpu"), config),
                     torch.tensor(kv.length), [l.keys for l in L], [l.values for l in L])
        return out[0][0]
    a = compiled(); e = m.forward(kv2, toks).logits; kv2.truncate(len(ids))
    print("max diff vs eager", (a - e).abs().max().item())
    ts = {"compiled": [], "eager": []}
    for r in range(15):
        t0 = time.perf_counter(); compiled(); ts["compiled"].append(time.perf_counter() - t0)
        t0 = time.perf_counter(); m.forward(kv2, toks); ts["eager"].append(time.perf_counter() - t0); kv2.truncate(len(ids))
    print({k: round(statistics.median(v) * 1000, 1) for k, v in ts.items()}, "ms for", W, "tokens at", len(ids), "cached")
