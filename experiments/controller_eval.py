"""Does speculation pay for itself on this machine? Every drafter with the cost-aware controller (and fixed k for
reference) against plain decoding, on grounded and open-ended prompts from the training set (not Spec-Bench).

Grounded prompts: dolly_with_context passages wrapped in summarise / rewrite / extract / correct tasks. Open
prompts: dolly_no_context and roleplay prompts (the same sets as experiments/compare_ngram.py). Methods run
interleaved per prompt, in a rotating order; the ratio is a method's tokens/s over plain decoding's on the same
prompt. Greedy, float32, the built-in model.

    python experiments/controller_eval.py --n 8 --out runs/controller.json
"""

import argparse
import json
import statistics
import sys
import time

from compare_ngram import prompt_sets

from verispec import EagleDrafter, NgramDrafter, SpeculativeDecoder, load_model
from verispec.bench.environment import environment

METHODS = {
    "ngram": lambda t: SpeculativeDecoder(t, NgramDrafter(), k=8),
    "ngram-fixed": lambda t: SpeculativeDecoder(t, NgramDrafter(), k=8, k_policy="fixed"),
    "eagle": lambda t: SpeculativeDecoder(t, EagleDrafter(t), k=8),
    "eagle-fixed": lambda t: SpeculativeDecoder(t, EagleDrafter(t), k=8, k_policy="fixed"),
    "eagle-tree": lambda t: SpeculativeDecoder(t, EagleDrafter(t, tree=True), k=16),
    "eagle-tree-fixed": lambda t: SpeculativeDecoder(t, EagleDrafter(t, tree=True), k=16, k_policy="fixed"),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", default="data/train-prompts/train_prompts.jsonl")
    ap.add_argument("--n", type=int, default=8, help="prompts per set")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--out", help="write every record and the summary as JSON here")
    args = ap.parse_args()
    target = load_model("smollm2-135m")
    names = args.methods.split(",")
    decoders = {"base": SpeculativeDecoder(target), **{m: METHODS[m](target) for m in names}}
    sets = prompt_sets(args.prompts, args.n)
    for d in decoders.values():  # warm up (and let the controller calibrate) on a prompt outside the sets
        d.generate("Write one sentence about the sea.", max_new_tokens=16)
    records = []
    order = list(decoders)
    for kind, prompts in sets.items():
        for i, prompt in enumerate(prompts):
            rot = order[i % len(order):] + order[: i % len(order)]
            outs = {}
            for name in rot:
                t0 = time.perf_counter()
                g = decoders[name].generate(prompt, max_new_tokens=args.max_new_tokens)
                outs[name] = (g, time.perf_counter() - t0)
            base, base_s = outs["base"]
            for name in names:
                g, s = outs[name]
                st = g.stats
                records.append({
                    "set": kind, "prompt": i, "method": name, "tokens": len(g.token_ids), "seconds": s,
                    "ratio": (len(g.token_ids) / s) / (len(base.token_ids) / base_s),
                    "identical": g.token_ids == base.token_ids, "mat": st.mean_accepted_tokens,
                    "plain_steps": st.plain_steps, "steps": st.verify_steps,
                    "predicted_speedup": st.predicted_speedup, "measured_speedup": st.measured_speedup,
                })
            print(kind, i, " ".join(f"{r['method']}={r['ratio']:.2f}" for r in records[-len(names):]),
                  file=sys.stderr, flush=True)
    summary = {}
    for name in names:
        row = {}
        for kind in [*sets, "all"]:
            rs = [r for r in records if r["method"] == name and (kind == "all" or r["set"] == kind)]
            row[kind] = {"median": statistics.median(r["ratio"] for r in rs), "min": min(r["ratio"] for r in rs),
                         "identical": sum(r["identical"] for r in rs) / len(rs),
                         "plain_step_share": sum(r["plain_steps"] for r in rs) / sum(r["steps"] for r in rs),
                         "mean_accepted_tokens": statistics.mean(r["mat"] for r in rs)}
        summary[name] = row
    print("| method | grounded median (min) | open median (min) | all median | identical | plain steps |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, row in summary.items():
        print(f"| {name} | {row['grounded']['median']:.2f}x ({row['grounded']['min']:.2f}) | "
              f"{row['open']['median']:.2f}x ({row['open']['min']:.2f}) | {row['all']['median']:.2f}x | "
              f"{100 * row['all']['identical']:.0f}% | {100 * row['all']['plain_step_share']:.0f}% |")
    if args.out:
        env = environment("float32", "cpu", target.packed_layers, target.linear_kernel)
        with open(args.out, "w") as fh:
            json.dump({"command": "python " + " ".join(sys.argv), "environment": env, "summary": summary,
                       "records": records}, fh, indent=1)


if __name__ == "__main__":
    main()
