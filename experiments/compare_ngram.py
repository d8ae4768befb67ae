"""Side-by-side speed of plain decoding and n-gram drafter settings on training prompts (not Spec-Bench).

Grounded prompts: dolly_with_context passages wrapped in summarise / rewrite / extract / correct tasks.
Open prompts: dolly_no_context and roleplay prompts. Methods run interleaved per prompt; the ratio is
tokens/s of the method over tokens/s of plain decoding on the same prompt, summarised by the median.

    python experiments/compare_ngram.py --prompts data/train-prompts/train_prompts.jsonl --n 10
"""

import argparse
import json
import random
import statistics

from verispec import NgramDrafter, SpeculativeDecoder, load_model

TASKS = [
    "Summarize the following text.\n\n{}",
    "Rewrite the following text in simpler words.\n\n{}",
    "Extract every name, date and number from the following text as a list.\n\n{}",
    "Correct any spelling and grammar mistakes in the following text and return the corrected text.\n\n{}",
]


def prompt_sets(path, n):
    rows = [json.loads(line) for line in open(path)]
    rng = random.Random(1)
    ctx = [r for r in rows if r["category"] == "dolly_with_context" and 400 < len(r["prompt"]) < 1500]
    open_ = [r for r in rows if r["category"] in ("dolly_no_context", "roleplay")]
    rng.shuffle(ctx)
    rng.shuffle(open_)
    grounded = [TASKS[i % 4].format(r["prompt"].split("\n\n", 1)[-1]) for i, r in enumerate(ctx[:n])]
    return {"grounded": grounded, "open": [r["prompt"] for r in open_[:n]]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", default="data/train-prompts/train_prompts.jsonl")
    ap.add_argument("--n", type=int, default=10, help="prompts per set")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--configs", default='{"ngram-default": {}}',
                    help='JSON {name: NgramDrafter kwargs (+ "k")}')
    args = ap.parse_args()
    target = load_model("smollm2-135m")
    decoders = {"base": SpeculativeDecoder(target)}
    for name, cfg in json.loads(args.configs).items():
        k = cfg.pop("k", 8)
        decoders[name] = SpeculativeDecoder(target, NgramDrafter(**cfg), k=k)
    decoders["base"].generate("Hello", max_new_tokens=8)  # warm-up
    for kind, prompts in prompt_sets(args.prompts, args.n).items():
        ratios = {n: [] for n in decoders if n != "base"}
        identical = True
        for p in prompts:
            res = {n: d.generate(p, max_new_tokens=args.max_new_tokens) for n, d in decoders.items()}
            for n in ratios:
                ratios[n].append(res[n].stats.tokens_per_second / res["base"].stats.tokens_per_second)
                identical &= res[n].token_ids == res["base"].token_ids
        summary = {n: {"median": round(statistics.median(v), 3), "mean": round(statistics.mean(v), 3)}
                   for n, v in ratios.items()}
        print(json.dumps({"set": kind, "prompts": len(prompts), "identical_to_plain": identical, "speedup": summary}),
              flush=True)


if __name__ == "__main__":
    main()
