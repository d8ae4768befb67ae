"""Write prompts that `verispec train-eagle` did NOT train on, as a JSONL prompt set for `verispec bench`.

train-eagle takes its prompts (training answers, then its own held-out check) as a prefix of a seeded shuffle of
the prompt file, keeping prompts of at most --max-prompt-tokens tokens. This script replays that selection and
writes the next N eligible prompts, which the head has never seen:

    python experiments/heldout_prompts.py --prompts data/train-prompts/train_prompts.jsonl --n 24 --out heldout.jsonl
    verispec bench --prompts heldout.jsonl --methods baseline,eagle --dtype bfloat16
"""

import argparse
import json
import random

from verispec import load_model
from verispec.training.data import chat_ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", required=True, help="the prompt file given to train-eagle")
    ap.add_argument("--n", type=int, default=24, help="held-out prompts to write (default: 24)")
    ap.add_argument("--out", required=True, help="JSONL to write")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--samples", type=int, default=2400, help="train-eagle's --samples (default: 2400)")
    ap.add_argument("--check-prompts", type=int, default=8, help="train-eagle's --check-prompts (default: 8)")
    ap.add_argument("--max-prompt-tokens", type=int, default=320, help="train-eagle's --max-prompt-tokens")
    ap.add_argument("--seed", type=int, default=0, help="train-eagle's --seed (default: 0)")
    args = ap.parse_args()

    rows = [json.loads(line) for line in open(args.prompts, encoding="utf-8") if line.strip()]
    tokenizer = load_model(args.target).tokenizer
    order = list(range(len(rows)))
    random.Random(args.seed).shuffle(order)  # the same order select_prompts uses
    used, written = 0, []
    for i in order:
        if len(chat_ids(tokenizer, rows[i]["prompt"])) > args.max_prompt_tokens:
            continue
        used += 1
        if used > args.samples + args.check_prompts:
            written.append({"question_id": rows[i]["id"], "category": rows[i]["category"], "turns": [rows[i]["prompt"]]})
            if len(written) == args.n:
                break
    with open(args.out, "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in written)
    print(f"wrote {len(written)} held-out prompts to {args.out}")


if __name__ == "__main__":
    main()
