"""Prompt prefill rate (tokens a second) per engine on one file, engines alternated round by round.

A prompt of n random tokens is fed in chunks of c tokens (as the server's batch engine prefills: one chunk a pass,
only the last position's logits), after nothing cached; the median round is printed per engine. Long prompts (Spec-Bench's
rag and summarization groups) make a server's throughput at 8 clients mostly this rate.

    python experiments/prefill_rate.py --target qwen2.5-coder-1.5b --backends blocks,llamacpp --tokens 1024 --chunk 128
    python experiments/prefill_rate.py --backends blocks --tokens 768 --chunk 64,128,256   # chunk sizes alternated
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from verispec.backends import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--backends", default="blocks,llamacpp")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--chunk", default="128", help="chunk sizes, comma-separated (each engine at each, alternated)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    models = {b: load_model(args.target, backend=b, threads=args.threads) for b in args.backends.split(",")}
    vocab = min(m.vocab_size for m in models.values())
    tokens = torch.randint(100, vocab, (args.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    chunks = [int(c) for c in args.chunk.split(",")]
    took: dict[tuple[str, int], list[float]] = {(b, c): [] for b in models for c in chunks}
    with torch.inference_mode():
        for r in range(args.rounds + 1):  # round 0 warms up
            for (name, chunk) in took:
                model, kv = models[name], models[name].new_kv()
                start = time.perf_counter()
                for i in range(0, len(tokens), chunk):
                    model.forward(kv, tokens[i : i + chunk], last_only=True)
                if r:
                    took[name, chunk].append(time.perf_counter() - start)
    for (name, chunk), times in took.items():
        t = statistics.median(times)
        print(f"{args.target} {name}: {args.tokens} tokens in chunks of {chunk}: {t:.2f} s, "
              f"{args.tokens / t:.0f} tokens/s (rounds: {', '.join(f'{x:.2f}' for x in times)})")


if __name__ == "__main__":
    main()
