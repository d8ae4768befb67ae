"""Soak the suffix drafter's store: N requests through one drafter (scope process), then its memory and the cost of
a proposal. Sequences are the training prompts tokenized by the default model's tokenizer, each followed by a
synthetic answer that repeats parts of earlier ones (so the index holds both fresh and repeated n-grams).

    python experiments/suffix_soak.py [--requests 1000] [--max-tokens 200000] [--min-n 1|2]

Prints the store's tokens and index entries and the Python heap it holds (tracemalloc) every 100 requests, and the
median and 99th-percentile microseconds of a proposal at the end.
"""

import argparse
import json
import random
import statistics
import time
import tracemalloc
from pathlib import Path

from verispec.drafters.suffix import SuffixDrafter, SuffixStore

PROMPTS = Path(__file__).resolve().parents[2] / "shared" / "train-prompts" / "train_prompts.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=200_000)
    ap.add_argument("--prompts", default=str(PROMPTS))
    ap.add_argument("--min-n", type=int, default=1, choices=(1, 2), help="the drafter's shortest match (default: 1)")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from verispec.backends.references import resolve

    tokenizer = AutoTokenizer.from_pretrained(resolve("smollm2-135m"))
    rows = [json.loads(line) for line in open(args.prompts, encoding="utf-8")]
    rng = random.Random(0)
    tracemalloc.start()
    store = SuffixStore(max_tokens=args.max_tokens)
    drafter = SuffixDrafter(store=store, min_n=args.min_n)
    answers: list[list[int]] = []
    costs = []
    for i in range(args.requests):
        row = rows[i % len(rows)]
        prompt = tokenizer(str(row.get("prompt") or row.get("instruction") or row))["input_ids"][:600]
        if answers and rng.random() < 0.5:
            base = rng.choice(answers)
            answer = base[: rng.randrange(1, len(base) + 1)] + [rng.randrange(49152) for _ in range(rng.randrange(20, 200))]
        else:
            answer = [rng.randrange(49152) for _ in range(rng.randrange(50, 400))]
        answers = (answers + [answer])[-200:]
        drafter.reset()
        context = list(prompt)
        for token in answer:
            t0 = time.perf_counter()
            drafter.propose(context, 8)
            costs.append(time.perf_counter() - t0)
            context.append(token)
        if (i + 1) % 100 == 0:
            heap, _ = tracemalloc.get_traced_memory()
            entries = sum(len(v) for v in store.index.values())
            print(f"{i + 1:5d} requests: {store.tokens:7d} tokens in {len(store.sequences):4d} sequences, "
                  f"{len(store.index):7d} keys, {entries:7d} index entries, heap {heap / 2**20:6.1f} MiB", flush=True)
    costs.sort()
    print(f"proposal: median {1e6 * statistics.median(costs):.0f} us, p99 {1e6 * costs[int(0.99 * len(costs))]:.0f} us "
          f"over {len(costs)} proposals")


if __name__ == "__main__":
    main()
