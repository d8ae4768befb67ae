"""Does a compiled decoder step beat verispec's eager packed path on this CPU? (an experiment, not a feature yet)

Compiles the default model with inductor (weights frozen, transformers' StaticCache, fixed shapes) for each pass
width, then times it against the eager model with prepacked weights and verispec's growing cache, interleaved.

    python scripts/compile_step.py default 1,9
    python scripts/compile_step.py max-autotune-no-cudagraphs 1
"""
import torch, time, statistics, sys
from transformers import StaticCache
from verispec import load_model
from verispec.cache import new_cache, truncate
torch.set_num_threads(2)
import torch._inductor.config as ic
ic.freezing = True
mode = sys.argv[1] if len(sys.argv) > 1 else "default"
widths = [int(w) for w in (sys.argv[2] if len(sys.argv) > 2 else "1,9").split(",")]
plain = load_model("smollm2-135m", pack=False).model
packed = load_model("smollm2-135m", pack=True).model
gen = torch.Generator().manual_seed(0)
ctx = torch.randint(0, 49152, (1, 300), generator=gen)
with torch.inference_mode():
    scache = StaticCache(config=plain.config, max_cache_len=512)
    plain(input_ids=ctx, past_key_values=scache, cache_position=torch.arange(300), use_cache=True, logits_to_keep=1)
    gcache = new_cache()
    packed(input_ids=ctx, past_key_values=gcache, use_cache=True, logits_to_keep=1)
    cm = torch.compile(plain, mode=mode, dynamic=False)
    for w in widths:
        x = torch.randint(0, 49152, (1, w), generator=gen); pos = torch.arange(300, 300 + w)
        t0 = time.perf_counter(); a = cm(input_ids=x, past_key_values=scache, cache_position=pos, use_cache=True).logits
        print(f"{mode}: compile width {w}: {time.perf_counter()-t0:.1f} s", flush=True)
        b = packed(input_ids=x, past_key_values=gcache, use_cache=True).logits; truncate(gcache, 300)
        print(f"  max |compiled - eager packed| = {(a-b).abs().max().item():.2e}, argmax equal: {torch.equal(a.argmax(-1), b.argmax(-1))}")
        tc, te = [], []
        for _ in range(9):
            t0 = time.perf_counter(); cm(input_ids=x, past_key_values=scache, cache_position=pos, use_cache=True); tc.append(time.perf_counter() - t0)
            t0 = time.perf_counter(); packed(input_ids=x, past_key_values=gcache, use_cache=True); te.append(time.perf_counter() - t0); truncate(gcache, 300)
        print(f"  width {w}: compiled {1e3*statistics.median(tc):.1f} ms, eager packed {1e3*statistics.median(te):.1f} ms", flush=True)
