"""The batch engine's prefill policy, A/B: joining prompts sharing each step's ``prefill_chunk`` tokens (now) against
one prompt's chunk a step (before 2026-12-05), the same prompts submitted together, alternated round by round.

N packaged Spec-Bench first turns (``--limit`` per group) join one ``BatchEngine`` at once, each with its own suffix
drafter (as ``verispec serve`` runs them); printed per policy: the median round's time until every prompt has its
first token, the time until all finish and the output tokens a second, and whether the outputs are the same.

    python experiments/prefill_policy_ab.py --target qwen2.5-coder-1.5b --backend blocks --limit 1 --rounds 2
    python experiments/prefill_policy_ab.py --categories qa,translation --limit 4 --rounds 2   # 8 short prompts
"""

from __future__ import annotations

import argparse
import statistics
import time

from verispec import SpeculativeDecoder, load_model
from verispec.batching import BatchEngine
from verispec.bench.prompts import load_questions, select
from verispec.drafters import SuffixDrafter


class OnePromptAStep(BatchEngine):
    """The policy before: a step feeds the first joining prompt alone, one chunk (whole when nothing runs)."""

    def _prefill(self) -> None:
        if self.prefilling:
            self._prefill_chunk(self.prefilling[0], self.prefill_chunk)


def step_all(engine, seqs, start: float) -> float | None:
    """Step the engine until it is idle; the seconds from ``start`` until every one of ``seqs`` had a token."""
    first = None
    while engine.busy:
        engine.step()
        if first is None and all(s.state is not None and s.state.generated for s in seqs):
            first = time.perf_counter() - start
    return first


def run(engine_type, target, prompts, max_new_tokens: int):
    engine = engine_type(target, max_batch=len(prompts))
    decoders = [SpeculativeDecoder(target, SuffixDrafter(scope="request")) for _ in prompts]
    start = time.perf_counter()
    seqs = [engine.submit(d, d.request(p, max_new_tokens=max_new_tokens)) for d, p in zip(decoders, prompts)]
    first = step_all(engine, seqs, start)
    wall = time.perf_counter() - start
    for s in seqs:
        if s.error is not None:
            raise s.error
    tokens = sum(len(s.result.token_ids) for s in seqs)
    return first if first is not None else wall, wall, tokens / wall, [s.result.token_ids for s in seqs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--backend", default="blocks")
    ap.add_argument("--limit", type=int, default=2, help="questions per Spec-Bench group (6 groups)")
    ap.add_argument("--categories", default="", help="groups or categories, comma-separated (default: all)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    target = load_model(args.target, backend=args.backend, threads=args.threads)
    prompts = [[{"role": "user", "content": q.turns[0]}] for q in select(load_questions(), args.categories.split(",") if args.categories else None,
                                                                        limit=args.limit)]
    policies = {"shared budget (now)": BatchEngine, "one prompt a step (before)": OnePromptAStep}
    results = {name: [] for name in policies}
    outputs = {}
    for r in range(args.rounds):
        for name, engine_type in (policies.items() if r % 2 == 0 else reversed(policies.items())):
            first, wall, rate, ids = run(engine_type, target, prompts, args.max_new_tokens)
            results[name].append((first, wall, rate))
            outputs.setdefault(name, ids)
            print(f"round {r} {name}: all started {first:.1f} s, all done {wall:.1f} s, {rate:.1f} tok/s", flush=True)
    print(f"{args.target} on {args.backend}, {len(prompts)} prompts together, {args.max_new_tokens} new tokens at most")
    for name, rows in results.items():
        first, wall, rate = (statistics.median(x[i] for x in rows) for i in range(3))
        print(f"| {name} | {first:.1f} s | {wall:.1f} s | {rate:.1f} tok/s |")
    same = len({tuple(map(tuple, ids)) for ids in outputs.values()}) == 1
    print("outputs identical across policies:", same)


if __name__ == "__main__":
    main()
