"""Where a decoding step's milliseconds go, plain decoding against a drafter, on one loaded target (docs/results-archive.md,
2026-11-28 13:40 UTC).

    python experiments/step_overhead.py [--prompts 6] [--tokens 128] [--backend llamacpp] [--weights f16] [--drafter eagle]

Times the engine's parts (the step's plan and settle, the controller's budget, the drafter's proposals, the target's
passes by width) with wall-clock timers around them, no profiler, while plain decoding and the drafter take turns on
Spec-Bench first turns spread over the groups; prints milliseconds per step of each part. What a drafter costs while
the controller steps aside is the difference between the two columns.
"""

import argparse
import collections
import time

from verispec import SpeculativeDecoder, load_model
from verispec.bench.prompts import load_questions
from verispec.drafters.registry import make_drafter


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--backend", default="llamacpp")
    ap.add_argument("--weights", default="f16")
    ap.add_argument("--drafter", default="eagle")
    args = ap.parse_args()
    target = load_model("smollm2-135m", backend=args.backend, weights=args.weights, threads=2)
    spent: dict[str, float] = collections.defaultdict(float)
    passes: dict[str, int] = collections.Counter()
    current = ["warm-up"]

    def timed(obj, name: str, key: str) -> None:
        inner = getattr(obj, name)

        def wrapper(*a, **k):
            t0 = time.perf_counter()
            out = inner(*a, **k)
            spent[f"{current[0]}.{key}"] += time.perf_counter() - t0
            return out
        setattr(obj, name, wrapper)

    forward = target.forward

    def timed_forward(kv, tokens, **k):
        t0 = time.perf_counter()
        out = forward(kv, tokens, **k)
        if len(tokens) <= 16:  # decoding passes, not prefills
            spent[f"{current[0]}.pass of {len(tokens)}"] += time.perf_counter() - t0
            passes[f"{current[0]}.pass of {len(tokens)}"] += 1
        return out
    target.forward = timed_forward
    drafter = make_drafter(args.drafter, target)
    decoders = {"plain": SpeculativeDecoder(target, None), args.drafter: SpeculativeDecoder(target, drafter)}
    for key, decoder in decoders.items():
        for name in ("plan", "settle", "advance"):
            timed(decoder, name, name)
        if decoder.drafter is not None:
            timed(decoder, "_draft_budget", "controller budget")
            timed(decoder, "_propose", "proposals")
    questions = load_questions(None)
    texts = [q.turns[0] for q in questions[:: max(1, len(questions) // args.prompts)][: args.prompts]]
    for decoder in decoders.values():
        decoder.generate(texts[0], max_new_tokens=8)
    spent.clear()
    passes.clear()
    steps: dict[str, int] = collections.Counter()
    walls: dict[str, float] = collections.Counter()
    for text in texts:
        for key, decoder in decoders.items():
            current[0] = key
            t0 = time.perf_counter()
            out = decoder.generate(text, max_new_tokens=args.tokens)
            walls[key] += time.perf_counter() - t0 - out.stats.prefill_seconds
            steps[key] += out.stats.verify_steps
    print(f"{target.kernel}; {args.drafter} reads layers {decoders[args.drafter].feature_layers or 'none'}; "
          f"{args.prompts} prompts, {args.tokens} tokens, greedy")
    for key in decoders:
        print(f"{key}: {steps[key]} steps, {1e3 * walls[key] / steps[key]:.2f} ms a step (prefill left out)")
        for part, seconds in sorted(spent.items()):
            if part.startswith(key + "."):
                count = f" ({passes[part]} passes, {1e3 * seconds / passes[part]:.2f} ms each)" if part in passes else ""
                print(f"  {part[len(key) + 1:]}: {1e3 * seconds / steps[key]:.3f} ms a step{count}")


if __name__ == "__main__":
    main()
