"""Kept caches, A/B: a conversation's second turn adopting its own first turn's cache (every finished sequence's cache
kept while its row is free, as the batch engine does since 2026-12-05) against the last finished one's only (as on
llama.cpp, and everywhere before), alternated round by round.

N MT-bench conversations (packaged Spec-Bench, two turns each): the first turns run together in one ``BatchEngine``
with ``max_batch`` N, then every second turn (user, the model's answer, user) is submitted at once. Printed per
policy: the median round's prompt tokens taken from kept caches, the time until every second turn has its first
token, and whether the second turns' outputs are the same.

    python experiments/kept_caches_ab.py --target qwen2.5-coder-1.5b --backend blocks --n 8 --rounds 2
"""

from __future__ import annotations

import argparse
import statistics
import time

from prefill_policy_ab import step_all
from verispec import SpeculativeDecoder, load_model
from verispec.batching import BatchEngine
from verispec.bench.prompts import load_questions, select


def second_turns(target, questions, max_new_tokens: int, keep_all: bool):
    engine = BatchEngine(target, max_batch=len(questions))
    engine.group.rows_apart = keep_all  # False: the last finished cache only
    chats = [[{"role": "user", "content": q.turns[0]}] for q in questions]
    decoders = [SpeculativeDecoder(target) for _ in questions]
    firsts = [engine.submit(d, d.request(c, max_new_tokens=max_new_tokens)) for d, c in zip(decoders, chats)]
    engine.run()
    for chat, seq, q in zip(chats, firsts, questions):
        chat += [{"role": "assistant", "content": seq.result.text}, {"role": "user", "content": q.turns[1]}]
    before = engine.counters.reused_prompt_tokens
    start = time.perf_counter()
    seqs = [engine.submit(d, d.request(c, max_new_tokens=max_new_tokens)) for d, c in zip(decoders, chats)]
    first = step_all(engine, seqs, start)
    return engine.counters.reused_prompt_tokens - before, first, [s.result.token_ids for s in seqs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--backend", default="blocks")
    ap.add_argument("--n", type=int, default=8, help="conversations (MT-bench questions)")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    target = load_model(args.target, backend=args.backend, threads=args.threads)
    questions = [q for q in select(load_questions(), ["mt_bench"]) if len(q.turns) > 1][: args.n]
    policies = {"every finished cache kept (now)": True, "the last finished cache only": False}
    rows = {name: [] for name in policies}
    outputs = {}
    for r in range(args.rounds):
        for name, keep_all in (policies.items() if r % 2 == 0 else reversed(policies.items())):
            reused, first, ids = second_turns(target, questions, args.max_new_tokens, keep_all)
            rows[name].append((reused, first))
            outputs.setdefault(name, ids)
            print(f"round {r} {name}: {reused} prompt tokens reused, every second turn started after {first:.1f} s",
                  flush=True)
    print(f"{args.target} on {args.backend}, {len(questions)} conversations, {args.max_new_tokens} new tokens a turn")
    for name, got in rows.items():
        print(f"| {name} | {statistics.median(x[0] for x in got):.0f} | {statistics.median(x[1] for x in got):.1f} s |")
    print("second turns identical across policies:", len({tuple(map(tuple, v)) for v in outputs.values()}) == 1)


if __name__ == "__main__":
    main()
