"""A drafter that pays per token, drafting as many tokens as the acceptance by position says pay (``stops_early``
off) against asking for the whole budget and stopping where its tokens' confidences say (on: the default since
2026-12-08), beside plain decoding; one target loaded once, the three decoders interleaved per prompt in a rotating
order, greedy. Prints per group the tok/s ratio to plain decoding (all tokens over all seconds), tokens a pass, and
whether every answer equals plain decoding's.

    python experiments/stop_early_ab.py --target smollm2-135m --backend transformers --drafter eagle --limit 2
    python experiments/stop_early_ab.py --target qwen2.5-coder-1.5b --backend blocks --drafter model --prompts code
"""

import argparse
import collections
import time

from verispec import SpeculativeDecoder, load_model
from verispec.bench.prompts import load_questions
from verispec.drafters import make_drafter


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--drafter", default="eagle", help="eagle (chains) or model")
    ap.add_argument("--draft-model", help="for --drafter model (default: the target's built-in sibling)")
    ap.add_argument("--prompts", default=None, help="a prompt set (default: Spec-Bench)")
    ap.add_argument("--limit", type=int, default=2, help="questions per group")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    target = load_model(args.target, backend=args.backend, threads=args.threads)
    draft_model = None
    if args.drafter == "model":
        draft_model = load_model(args.draft_model or "qwen2.5-coder-0.5b", backend=args.backend, threads=args.threads)

    def decoder(stops_early: bool | None) -> SpeculativeDecoder:
        if stops_early is None:
            return SpeculativeDecoder(target)
        drafter = make_drafter(args.drafter, target=target, draft_model=draft_model)
        drafter.stops_early = stops_early  # read by the decoder's controller when it is built
        return SpeculativeDecoder(target, drafter, k=args.k)

    decoders = {"plain": decoder(None), "by position": decoder(False), "stops early": decoder(True)}
    for d in decoders.values():  # warm-up: the controller's first calibration, compiled programs
        d.generate("Write one sentence about the sea.", max_new_tokens=16)
    per_group = collections.Counter()
    questions = [q for q in load_questions(args.prompts) if per_group.update([q.group]) or per_group[q.group] <= args.limit]
    totals = collections.defaultdict(lambda: [0, 0.0, 0, 0, 0])  # tokens, seconds, passes, answers, identical
    order = list(decoders)
    for i, q in enumerate(questions):
        outs = {}
        for name in order[i % 3:] + order[: i % 3]:
            start = time.perf_counter()
            outs[name] = (decoders[name].generate(q.turns[0], max_new_tokens=args.max_new_tokens),
                          time.perf_counter() - start)
        for name, (g, seconds) in outs.items():
            for key in (q.group, "all"):
                t = totals[name, key]
                t[0] += len(g.token_ids)
                t[1] += seconds
                t[2] += g.stats.verify_steps
                t[3] += 1
                t[4] += g.token_ids == outs["plain"][0].token_ids
        print(q.question_id, " ".join(f"{n} {len(g.token_ids) / s:.1f} tok/s" for n, (g, s) in outs.items()), flush=True)
    groups = sorted({q.group for q in questions}) + ["all"]
    print(f"\n{args.drafter} drafting for {args.target} on {target.backend}; tok/s ratio to plain (tokens a pass)")
    print("| method | " + " | ".join(groups) + " | equal to plain |")
    print("|---|" + "---:|" * (len(groups) + 1))
    for name in ("by position", "stops early"):
        cells = []
        for g in groups:
            t, p = totals[name, g], totals["plain", g]
            cells.append(f"{(t[0] / t[1]) / (p[0] / p[1]):.2f}x ({t[0] / t[2]:.2f})")
        a = totals[name, "all"]
        print(f"| {name} | " + " | ".join(cells) + f" | {a[4]}/{a[3]} |")


if __name__ == "__main__":
    main()
