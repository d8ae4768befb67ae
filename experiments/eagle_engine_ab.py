"""The EAGLE head's engines side by side on one compiled target (docs/results-archive.md, 2026-11-28).

    python experiments/eagle_engine_ab.py [--prompts 18] [--tokens 128] [--engines torch,compiled] [--temperature 0]
                                      [--k 0] [--tree]

One load of the default model with its compiled passes (`verispec compile` first); one EAGLE drafter per engine
(the compiled one is built here if `verispec compile` has not stored it), decoding Spec-Bench first turns (every
Nth question, so every group) interleaved per prompt with plain decoding. `--k 0` is the controller, else a fixed
draft length. Prints tok/s against plain, tokens a step, the drafter's milliseconds a step, and how many answers
equal plain decoding's (greedy; sampled answers follow other draws).
"""

import argparse
import time

from verispec import SpeculativeDecoder, load_model
from verispec.bench.prompts import load_questions
from verispec.drafters.eagle import EagleDrafter


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=18, help="Spec-Bench first turns, spread over the groups")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--engines", default="torch,compiled")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--k", type=int, default=0, help="0: the controller picks each step's draft length")
    ap.add_argument("--tree", action="store_true", help="EAGLE trees (their extra depths run the torch head)")
    args = ap.parse_args()
    target = load_model("smollm2-135m", compiled="on")
    policy = dict(k_policy="fixed", k=args.k) if args.k else {}
    decoders = {"plain": SpeculativeDecoder(target, None)}
    for engine in args.engines.split(","):
        drafter = EagleDrafter(target, engine=engine, tree=args.tree)
        assert drafter.engine == engine, (drafter.engine, engine)
        decoders[engine] = SpeculativeDecoder(target, drafter, **policy)
    questions = load_questions(None)
    step = max(1, len(questions) // args.prompts)
    texts = [q.turns[0] for q in questions[::step][: args.prompts]]
    for decoder in decoders.values():
        decoder.generate(texts[0], max_new_tokens=16)  # warm-up
    runs = {key: [] for key in decoders}
    for i, text in enumerate(texts):
        for key, decoder in decoders.items():
            t0 = time.perf_counter()
            out = decoder.generate(text, max_new_tokens=args.tokens, temperature=args.temperature, seed=i)
            runs[key].append((out, time.perf_counter() - t0))
    reference = [out.token_ids for out, _ in runs["plain"]]
    base = None
    print(f"temperature {args.temperature}, {'tree' if args.tree else 'chain'}, "
          f"{'controller' if not args.k else f'k = {args.k}'}, {len(texts)} prompts, {args.tokens} tokens")
    print("| engine | tok/s | vs plain | tokens a step | drafter ms a step | same as plain |")
    print("|---|---:|---:|---:|---:|---:|")
    for key, outs in runs.items():
        tokens = sum(len(o.token_ids) for o, _ in outs)
        seconds = sum(s for _, s in outs)
        steps = sum(o.stats.verify_steps for o, _ in outs)
        draft = sum(o.stats.draft_seconds for o, _ in outs)
        same = (f"{sum(o.token_ids == r for (o, _), r in zip(outs, reference))}/{len(outs)}" if args.temperature == 0
                else "n/a")  # sampled answers differ from plain decoding's draws by design
        rate = tokens / seconds
        base = base or rate
        print(f"| {key} | {rate:.1f} | {rate / base:.2f}x | {tokens / max(steps, 1):.2f} | "
              f"{1e3 * draft / max(steps, 1):.2f} | {same} |", flush=True)


if __name__ == "__main__":
    main()
