"""What batching buys per backend and weight format: N prompts decoded one after another vs together.

    python experiments/batch_engine_speed.py [--n 8] [--max-new-tokens 96] [--rounds 2]

For each target (transformers float32; llama.cpp on the shipped Q4_1 file and on F32 weights) it decodes the same N
Spec-Bench prompts (every 30th question, first turn) with plain greedy decoding, once sequentially (one lone
decoder after another) and once as one continuous batch of N, alternating in each round, and prints output
tokens/s for both and their ratio, and whether every output is identical. No server, no HTTP: the engine only.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from verispec import SpeculativeDecoder, load_model
from verispec.batching import generate_batch

QUESTIONS = Path(__file__).resolve().parents[2] / "shared" / "specbench" / "question.jsonl"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--questions", type=Path, default=QUESTIONS)
    args = ap.parse_args()
    rows = [json.loads(line) for line in args.questions.open()]
    prompts = [r["turns"][0] for r in rows[::30][: args.n]]
    targets = {
        "transformers float32": lambda: load_model("smollm2-135m"),
        "llama.cpp Q4_1 (as shipped)": lambda: load_model("smollm2-135m", backend="llamacpp", sequences=args.n + 1),
        "llama.cpp F32": lambda: load_model("smollm2-135m", backend="llamacpp", weights="f32",
                                             sequences=args.n + 1),
    }
    print("| target | sequential tok/s | batch of N tok/s | ratio | identical outputs |")
    print("|---|---|---|---|---|")
    for name, load in targets.items():
        target = load()
        seq_rates, batch_rates, same = [], [], True
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            lone = [SpeculativeDecoder(target, reuse_prefix=False).generate(p, max_new_tokens=args.max_new_tokens)
                    for p in prompts]
            seq_rates.append(sum(len(g.token_ids) for g in lone) / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            together = generate_batch([SpeculativeDecoder(target) for _ in prompts], prompts, max_batch=args.n,
                                      max_new_tokens=args.max_new_tokens)
            batch_rates.append(sum(len(g.token_ids) for g in together) / (time.perf_counter() - t0))
            same &= all(a.token_ids == b.token_ids for a, b in zip(lone, together))
        s, b = max(seq_rates), max(batch_rates)
        print(f"| {name} | {s:.1f} | {b:.1f} | {b / s:.2f}x | {'yes' if same else 'no'} |", flush=True)
        del target
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
