"""What `--backend auto` would measure for each engine on each built-in file: its timed pass costs and score.

    python experiments/auto_scores.py [--targets smollm2-135m,gemma3-270m,...] [--backends llamacpp,blocks]
                                      [--rounds 2]

For every target and backend (the backends' order alternating from round to round, so that a slow spell of a shared
machine hits both alike): the model loaded as `--backend auto` loads it, `timing.time_widths` (the widths, cached
positions and prefill auto times with) and `timing.auto_score` (estimated ms a generated token for speculation).
Prints one markdown row per target and backend with the medians over rounds, beside the file's bytes per pass that
each backend declares (`BackendSpec.cost`): the figures the blocks backend's declared cost is fitted to
(docs/kernels.md, "--backend auto and the blocks backend").
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys

TARGETS = "smollm2-135m,gemma3-270m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--targets", default=TARGETS)
    ap.add_argument("--backends", default="llamacpp,blocks")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    from verispec.backends import load_model, timing
    from verispec.backends.references import gguf_type_bytes
    from verispec.backends.registry import get_backend
    from verispec.backends.torch_cpu.cpu import cpu_info

    threads = args.threads or timing.default_threads()
    backends = args.backends.split(",")
    print(f"CPU: {cpu_info()['model']}, {threads} threads", flush=True)
    print("| file | backend | declared cost (MB) | " + " | ".join(f"w = {w} ms" for w in timing.AUTO_WIDTHS)
          + " | prefill ms a token | score ms a token |")
    print("|---|---|---:|" + "---:|" * (len(timing.AUTO_WIDTHS) + 2))
    for target in args.targets.split(","):
        mix = gguf_type_bytes(target)
        runs = {b: [] for b in backends}
        for r in range(args.rounds):
            for backend in (backends if r % 2 == 0 else backends[::-1]):
                model = load_model(target, backend=backend, threads=threads)
                runs[backend].append(timing.time_widths(model))
                del model
                gc.collect()
        for backend in backends:
            ms = {k: statistics.median(run[k] for run in runs[backend]) for k in runs[backend][0]}
            cost = get_backend(backend).cost
            declared = f"{cost(mix) / 1e6:.0f}" if cost else ""
            print(f"| {target} | {backend} | {declared} | "
                  + " | ".join(f"{ms[str(w)]:.1f}" for w in timing.AUTO_WIDTHS)
                  + f" | {ms['prefill']:.2f} | {timing.auto_score(ms):.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
