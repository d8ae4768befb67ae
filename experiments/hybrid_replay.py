"""Suffix drafts, a draft model, and suffix-else-draft-model replayed offline on a bench run's greedy answers (as
suffix_ceiling.py replays suffix drafts): what a drafter that asks the suffix store first and the draft model where
the store has nothing could give, before building one.

At every position of every answer: the suffix drafter's proposal and how much of it the answer accepts
(suffix_ceiling.replay), and how many of the draft model's greedy tokens the answer accepts (the draft model's argmax
after the prompt and the answer so far, one teacher-forced pass per answer: while its tokens match the answer, its
context is the answer's). Policies walk each answer on the target's cost curve:

- suffix (oracle): verify exactly what the store's draft gets accepted, a lookup's cost (--lookup-ms) a draft;
- model: draft until the first miss (what a confidence-driven stop at best does), at most --k, --draft-ms a token;
- suffix, else model: the store's draft where it has one, else the model's; after steps the model did not draft,
  its next draft pays one catch-up pass (--catch-up-ms) over the tokens committed meanwhile.

Speedups are over plain decoding on the same curve.

    python experiments/hybrid_replay.py runs/base_code --costs 1:47.5,2:53.7,4:60.5,8:83,16:106.4 --draft-ms 23
"""

import argparse
import sys

import torch

from suffix_ceiling import cost_curve, load_run, replay
from verispec import load_model


def model_runs(records, tokenizer, draft) -> dict[str, list[int]]:
    """Per answer: at each position, how many of the draft model's greedy tokens from there match the answer."""
    out = {}
    for r in records:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": r["prompt_text"]}], add_generation_prompt=True,
                                               tokenize=True, return_dict=True)["input_ids"]
        answer = r["token_ids"]
        with torch.inference_mode():
            logits = draft.forward(draft.new_kv(), prompt + answer).logits
        predicted = logits.argmax(-1).tolist()
        hit = [predicted[len(prompt) - 1 + p] == answer[p] for p in range(len(answer))]
        runs, run = [0] * len(answer), 0
        for p in range(len(answer) - 1, -1, -1):
            run = run + 1 if hit[p] else 0
            runs[p] = run
        out[str(r["question_id"])] = runs
    return out


def walk(suffix_rows, model_run, policy, cost, args) -> tuple[float, float]:
    """(tokens, ms) of one answer under ``policy`` (suffix, model or hybrid)."""
    p = tokens = ms = 0
    behind = 0  # committed tokens the draft model has not read
    while p < len(suffix_rows):
        s = suffix_rows[p]
        use_suffix = policy == "suffix" or (policy == "hybrid" and s["n"] > 0)
        if use_suffix:
            n = min(s["a"], s["n"])
            step = cost(n + 1) + (args.lookup_ms if s["n"] else 0.0)
            got = n + 1
        else:
            a = model_run[p]
            n = min(a + 1, args.k)
            step = n * args.draft_ms + cost(n + 1) + (args.catch_up_ms if behind else 0.0)
            got = min(a, n) + 1
        got = min(got, len(suffix_rows) - p)
        behind = got if use_suffix else 0
        tokens, ms, p = tokens + got, ms + step, p + got
    return tokens, ms


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", help="a verispec bench output folder whose records hold greedy baseline answers")
    ap.add_argument("--costs", required=True, help="the target's pass ms by width, e.g. 1:47.5,2:53.7,4:60.5,8:83")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b", help="the draft model (default: qwen2.5-coder-0.5b)")
    ap.add_argument("--draft-ms", type=float, required=True, help="ms a draft token costs the draft model")
    ap.add_argument("--catch-up-ms", type=float, default=None, help="ms of the draft's catch-up pass (default: "
                    "--draft-ms)")
    ap.add_argument("--lookup-ms", type=float, default=0.7, help="ms a suffix lookup costs (default: 0.7)")
    ap.add_argument("--k", type=int, default=8, help="most draft-model tokens a step (default: 8)")
    args = ap.parse_args()
    args.catch_up_ms = args.draft_ms if args.catch_up_ms is None else args.catch_up_ms
    cost = cost_curve(args.costs)
    records, prompts, tokenizer = load_run(args.run)
    for r in records:
        r["prompt_text"] = prompts[str(r["question_id"])]
    suffix = replay(records, prompts, tokenizer, 32)
    runs = model_runs(records, tokenizer, load_model(args.draft, backend="blocks", threads=2))
    groups = sorted({a["group"] for a in suffix.values()})
    print(f"{len(records)} answers; target {args.costs} ms; draft {args.draft_ms} ms a token; speedup over plain")
    print("| drafter | " + " | ".join(groups) + " | all |")
    print("|---|" + "---:|" * (len(groups) + 1))
    for policy in ("suffix", "model", "hybrid"):
        cells = []
        for group in [*groups, None]:
            tokens = ms = 0.0
            for qid, a in suffix.items():
                if group is None or a["group"] == group:
                    t, m = walk(a["rows"], runs[qid], policy, cost, args)
                    tokens, ms = tokens + t, ms + m
            cells.append(f"{tokens / ms * cost(1):.2f}x")
        print(f"| {policy} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
