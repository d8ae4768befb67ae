"""Draft || verify against sequential drafting with a draft model, and the thread split that suits it.

Loads the target and its draft model on one backend, then answers the shipped code prompts (or Spec-Bench's) with
plain decoding, the draft model drafting sequentially, and the draft model drafting while the target verifies
(``ParallelModelDrafter``), each configuration's threads as given; configurations interleaved per question, greedy,
every answer checked against plain decoding.

    python experiments/draft_parallel.py --backend openvino --limit 2 \
        --configs 'plain:2,seq:2/2,par:2/1,par:1/1'

A configuration is ``KIND:TARGET_THREADS[/DRAFT_THREADS]``, KIND one of plain, seq, par. Results in
docs/draft-models.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

from verispec import SpeculativeDecoder
from verispec.backends import load_model
from verispec.bench.prompts import load_questions, select
from verispec.drafters.model import ParallelModelDrafter
from verispec.drafters.model import ModelDrafter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--backend", default="openvino")
    parser.add_argument("--weights", default="as-is")
    parser.add_argument("--prompts", default="code")
    parser.add_argument("--limit", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--k-policy", default="cost")
    parser.add_argument("--configs", default="plain:2,seq:2/2,par:2/2,par:1/1")
    args = parser.parse_args()

    models: dict[tuple[str, int], object] = {}

    def model(ref: str, threads: int):
        if (ref, threads) not in models:
            models[ref, threads] = load_model(ref, backend=args.backend, weights=args.weights, threads=threads)
        return models[ref, threads]

    decoders = {}
    for config in args.configs.split(","):
        kind, _, threads = config.partition(":")
        t_threads, _, d_threads = threads.partition("/")
        target = model(args.target, int(t_threads))
        if kind == "plain":
            decoders[config] = SpeculativeDecoder(target, reuse_prefix=False)  # every answer prefills its prompt
            continue
        draft = model(args.draft, int(d_threads or t_threads))
        drafter = (ParallelModelDrafter if kind == "par" else ModelDrafter)(draft, target, check_chat_template=False)
        decoders[config] = SpeculativeDecoder(target, drafter, k=args.k, k_policy=args.k_policy, reuse_prefix=False)

    questions = select(load_questions(args.prompts), limit=args.limit)
    plain_config = next((c for c in decoders if c.startswith("plain")), None)
    totals = {c: {"tokens": 0, "seconds": 0.0, "equal": 0, "answers": 0, "steps": 0} for c in decoders}
    by_group: dict[str, dict[str, list[float]]] = {}
    for i, q in enumerate(questions):
        outputs = {}
        for config, decoder in decoders.items():
            if i == 0:  # warm-up: first passes, compiled widths
                decoder.generate(q.turns[0], max_new_tokens=16)
            start = time.perf_counter()
            g = decoder.generate(q.turns[0], max_new_tokens=args.max_new_tokens)
            seconds = time.perf_counter() - start
            outputs[config] = g.token_ids
            t = totals[config]
            t["tokens"] += len(g.token_ids)
            t["seconds"] += seconds
            t["answers"] += 1
            t["steps"] += g.stats.verify_steps
            group = by_group.setdefault(q.category, {}).setdefault(config, [0, 0.0])
            group[0] += len(g.token_ids)
            group[1] += seconds
            print(f"{q.question_id} {config:>10}: {len(g.token_ids) / seconds:6.2f} tok/s "
                  f"{len(g.token_ids) / max(1, g.stats.verify_steps):.2f} tok/step", flush=True)
        if plain_config:
            for config, ids in outputs.items():
                totals[config]["equal"] += ids == outputs[plain_config]
    print(f"\n{platform.processor() or platform.machine()}; {args.backend} {args.weights}; target {args.target}, "
          f"draft {args.draft}; k={args.k} policy {args.k_policy}; {len(questions)} questions\n")
    print("| configuration | tok/s | vs plain | tokens/step | equal to plain |" + "".join(
        f" {g} tok/s |" for g in by_group))
    print("|---|---:|---:|---:|---:|" + "---:|" * len(by_group))
    base = totals[plain_config]["tokens"] / totals[plain_config]["seconds"] if plain_config else None
    for config, t in totals.items():
        rate = t["tokens"] / t["seconds"]
        groups = "".join(f" {v[config][0] / v[config][1]:.2f} |" for v in by_group.values())
        hits = ""
        drafter = decoders[config].drafter
        if isinstance(drafter, ParallelModelDrafter):
            hits = f" (worker's drafts used {drafter.hits}, dropped {drafter.misses})"
        print(f"| {config}{hits} | {rate:.2f} | {rate / base if base else float('nan'):.2f}x | "
              f"{t['tokens'] / max(1, t['steps']):.2f} | {t['equal']}/{t['answers']} |{groups}")
    print(json.dumps({c: {k: round(v, 3) if isinstance(v, float) else v for k, v in t.items()}
                      for c, t in totals.items()}))


if __name__ == "__main__":
    main()
