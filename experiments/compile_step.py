"""Does a compiled decoder step beat verispec's eager packed path on this CPU? The experiment that led to `--compile`
(verispec.backends.hf.compiled, the feature, compiles the one-token step only; this script compiles every width).

Compiles the default model with inductor (weights frozen, transformers' StaticCache, fixed shapes) for each pass
width, then times it against the eager model with prepacked weights and verispec's growing cache, interleaved.

    python experiments/compile_step.py default 1,9
    python experiments/compile_step.py max-autotune-no-cudagraphs 1
    python experiments/compile_step.py max-autotune-no-cudagraphs 1,9 --no-freezing
    python experiments/compile_step.py none 1,9       # the same loop uncompiled: checks the loop, not the compiler

Each width's first pass is also compared with a fresh full forward over the context and the new tokens (no cache),
which says which side is wrong when the compiled and eager passes disagree.
"""
import statistics
import sys
import time

import torch
import torch._inductor.config as inductor_config
from transformers import StaticCache

from verispec import load_model
from verispec.backends.hf.cache import new_cache, truncate

CONTEXT = 300


def seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    mode = args[0] if args else "default"
    widths = [int(w) for w in (args[1] if len(args) > 1 else "1,9").split(",")]
    torch.set_num_threads(2)
    inductor_config.freezing = "--no-freezing" not in sys.argv
    plain = load_model("smollm2-135m", pack=False).model
    packed = load_model("smollm2-135m", pack=True).model
    gen = torch.Generator().manual_seed(0)
    ctx = torch.randint(0, 49152, (1, CONTEXT), generator=gen)
    with torch.inference_mode():
        static = StaticCache(config=plain.config, max_cache_len=512)
        plain(input_ids=ctx, cache=static, cache_position=torch.arange(CONTEXT), use_cache=True,
              logits_to_keep=1)
        growing = new_cache()
        packed(input_ids=ctx, cache=growing, use_cache=True, logits_to_keep=1)
        compiled = plain if mode == "none" else torch.compile(plain, mode=mode, dynamic=False)
        for w in widths:
            x = torch.randint(0, 49152, (1, w), generator=gen)
            pos = torch.arange(CONTEXT, CONTEXT + w)
            # the mask must be explicit: without it transformers' static-cache path took a causal shortcut that
            # does not hold for several new tokens, and the 9-token pass disagreed with eager (max |diff| 4.1)
            mask = torch.ones(1, CONTEXT + w, dtype=torch.long)

            def run_compiled():
                return compiled(input_ids=x, cache=static, cache_position=pos, attention_mask=mask,
                                use_cache=True).logits

            def run_eager():
                logits = packed(input_ids=x, cache=growing, use_cache=True).logits
                truncate(growing, CONTEXT)
                return logits

            t0 = time.perf_counter()
            a = run_compiled()
            print(f"{mode}: compile width {w}: {time.perf_counter() - t0:.1f} s", flush=True)
            b = run_eager()
            ref = plain(input_ids=torch.cat([ctx, x], 1)).logits[:, -w:]
            print(f"  vs a fresh full forward: compiled {(a - ref).abs().max().item():.2e}, "
                  f"eager packed {(b - ref).abs().max().item():.2e}", flush=True)
            print(f"  max |compiled - eager packed| = {(a - b).abs().max().item():.2e}, "
                  f"argmax equal: {torch.equal(a.argmax(-1), b.argmax(-1))}")
            tc, te = [], []
            for _ in range(9):  # interleaved
                tc.append(seconds(run_compiled))
                te.append(seconds(run_eager))
            print(f"  width {w}: compiled {1e3 * statistics.median(tc):.1f} ms, "
                  f"eager packed {1e3 * statistics.median(te):.1f} ms", flush=True)


if __name__ == "__main__":
    main()
