"""How far suffix drafts can speed up a set of greedy answers on a given pass-cost curve, whatever the controller does.

Reads the greedy answers of a `verispec bench` run (its records.jsonl: the baseline method's token ids, prompts
rebuilt with the target's chat template) and replays them offline: at every position of every answer the suffix
drafter (as `verispec serve` runs it: one process-wide store, the prompts and answers in the order asked) proposes up
to --most tokens, and the answer says how many of them greedy verification would accept. Then policies walk each
answer, each step verifying n drafts (a pass of n + 1 tokens at the curve's cost, linear between the given widths and
past the last) and committing min(accepted, n) + 1 tokens:

- oracle: n = exactly the tokens that will be accepted (no policy can do better with these drafts);
- fixed-k: n = k (up to the draft's length);
- by match length: n chosen per length of the suffix match (the drafter's evidence), fitted on the same answers (an
  in-sample ceiling for policies that read only that);
- free passes: the oracle again with every width costing one token's pass.

Speedups are over plain decoding on the same curve (one token a pass). No model runs; the tokenizer loads.

    python -m verispec bench --target qwen2.5-coder-1.5b --backend blocks --prompts code --max-new-tokens 128 \\
        --methods baseline --warmup 0 --no-plots --no-quality --out runs/base_code
    python experiments/suffix_ceiling.py runs/base_code --costs 1:42.4,2:48.8,4:60.8,8:105.6,16:209
"""

import argparse
import collections
import json
import sys
from pathlib import Path

from verispec.backends.references import ensure_tokenizer
from verispec.bench.prompts import load_questions
from verispec.drafters.suffix import SuffixDrafter, SuffixStore, _Trie


def cost_curve(text: str):
    points = {int(w): float(ms) for w, ms in (p.split(":") for p in text.split(","))}
    widths = sorted(points)

    def cost(w: int) -> float:
        if w in points:
            return points[w]
        if w > widths[-1]:
            a, b = widths[-2], widths[-1]
            return points[b] + (points[b] - points[a]) / (b - a) * (w - b)
        lo = max(x for x in widths if x < w)
        hi = min(x for x in widths if x > w)
        return points[lo] + (points[hi] - points[lo]) * (w - lo) / (hi - lo)

    return cost


def replay(records: list[dict], prompts: dict, tokenizer, most: int, first=None) -> dict[str, list[dict]]:
    """Per answer (question id): at each position the draft's length, the suffix match's length and the tokens
    greedy verification accepts. ``first(store, drafter, prompt)``, if given, is called per answer and returns a
    function of (context, position, answer) whose draft, where it gives one, is taken instead of the suffix
    drafter's (match length 0): another drafter replayed beside it (experiments/copy_pointer_replay.py)."""
    store = SuffixStore()
    out = {}
    for r in records:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompts[str(r["question_id"])]}],
                                               add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        answer = r["token_ids"]
        drafter = SuffixDrafter(store=store)
        drafter.reset()
        own = first(store, drafter, prompt) if first else None
        rows = []
        for p in range(len(answer)):
            context = prompt + answer[:p]
            drafter._sync(context)
            tokens, match = (own(context, p, answer) if own else None), 0
            if not tokens:
                match, conts = store.matches(context, drafter.max_match, most,
                                             exclude_end=(drafter._sid, len(context)), min_n=drafter.min_n)
                conts = [c for c in conts if c]
                tokens = _Trie(conts).best_chain(most, drafter.min_share)[0] if conts else []
            accepted = 0
            while accepted < len(tokens) and p + accepted < len(answer) and tokens[accepted] == answer[p + accepted]:
                accepted += 1
            rows.append({"n": len(tokens), "m": match if tokens else 0, "a": accepted})
        drafter._finish()
        out[str(r["question_id"])] = {"group": r["group"], "rows": rows}
    return out


def speedup(answers: dict, policy, cost, group: str | None = None) -> float:
    tokens = seconds = 0.0
    for a in answers.values():
        if group and a["group"] != group:
            continue
        rows, p = a["rows"], 0
        while p < len(rows):
            r = rows[p]
            n = max(0, min(policy(r), r["n"]))
            got = min(min(r["a"], n) + 1, len(rows) - p)
            tokens, seconds, p = tokens + got, seconds + cost(n + 1), p + got
    return tokens / seconds * cost(1)


def load_run(run: str, method: str = "baseline"):
    """(the first-turn records of ``method``, {question id: prompt}, the target's tokenizer) of a bench run."""
    records = [json.loads(line) for line in open(Path(run) / "records.jsonl")]
    records = [r for r in records if r["method"] == method and r["turn"] == 1]
    if not records:
        sys.exit(f"no first-turn records of method {method!r} in {run}")
    config = json.loads((Path(run) / "summary.json").read_text())["config"]
    prompts = {str(q.question_id): q.turns[0] for q in load_questions(config.get("prompts"))}
    tokenizer = __import__("transformers").AutoTokenizer.from_pretrained(str(ensure_tokenizer(config["target"])))
    return records, prompts, tokenizer


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", help="a verispec bench output folder whose records hold greedy baseline answers")
    ap.add_argument("--costs", required=True, help="pass ms by width, e.g. 1:42.4,2:48.8,4:60.8,8:105.6,16:209")
    ap.add_argument("--method", default="baseline", help="the method whose answers to replay (default: baseline)")
    ap.add_argument("--most", type=int, default=32, help="longest draft proposed (default: 32)")
    args = ap.parse_args()
    cost = cost_curve(args.costs)
    records, prompts, tokenizer = load_run(args.run, args.method)
    answers = replay(records, prompts, tokenizer, args.most)
    by_match = collections.defaultdict(list)
    for a in answers.values():
        for r in a["rows"]:
            if r["n"]:
                by_match[min(r["m"], 24)].append(r)
    fitted = {m: max(range(args.most + 1), key=lambda n: sum(min(r["a"], n, r["n"]) + 1 for r in rs)
                     / sum(cost(min(n, r["n"]) + 1) for r in rs)) for m, rs in by_match.items()}
    policies = {"oracle": lambda r: r["a"], **{f"fixed-{k}": (lambda r, k=k: k) for k in (1, 2, 3, 4, 8, 16)},
                "by match length (fitted)": lambda r: fitted.get(min(r["m"], 24), 0)}
    groups = sorted({a["group"] for a in answers.values()})
    print(f"{len(answers)} answers, costs {args.costs} ms; speedup over plain decoding on that curve")
    print("| policy | " + " | ".join(groups) + " | all |")
    print("|---|" + "---:|" * (len(groups) + 1))
    for name, policy in policies.items():
        print(f"| {name} | " + " | ".join(f"{speedup(answers, policy, cost, g):.2f}x" for g in groups)
              + f" | {speedup(answers, policy, cost):.2f}x |")
    free = lambda w: cost(1)  # noqa: E731
    print("| oracle, free passes | " + " | ".join(f"{speedup(answers, policies['oracle'], free, g):.2f}x"
                                                for g in groups) + f" | {speedup(answers, policies['oracle'], free):.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
