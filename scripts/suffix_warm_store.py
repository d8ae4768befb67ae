"""Would a suffix store seeded with the target's own answers to other prompts draft more? (docs/suffix.md)

    python scripts/suffix_warm_store.py --answers 300 --sizes 0,100,300

Answers ``--answers`` training prompts (``../shared/train-prompts``, shuffled with seed 0; never Spec-Bench) greedily on
the OpenVINO backend, then decodes every 10th Spec-Bench question (first turns, 128 tokens, fixed k = 5) with suffix
drafts from a store holding the first N of those answers, for each N in ``--sizes``, and prints tokens per verify
pass overall and per category. Each question's own sequence is dropped from the store after it, so every question
sees the same seed. Acceptance only: tokens per pass do not depend on the machine's speed.
"""

import argparse
import collections
import json
import random
from pathlib import Path

from tqdm import tqdm

from verispec import SpeculativeDecoder, make_drafter
from verispec.backends.openvino.model import load
from verispec.bench.prompts import PACKAGED
from verispec.drafters.suffix import SuffixStore

TRAIN = Path(__file__).resolve().parents[2] / "shared" / "train-prompts" / "train_prompts.jsonl"


def seeded(answers: list[list[int]]) -> SuffixStore:
    store = SuffixStore()
    for answer in answers:
        sid = store.open()
        store.extend(sid, answer)
        store.close(sid)
    return store


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--answers", type=int, default=300)
    parser.add_argument("--sizes", default="0,100,300")
    parser.add_argument("--weights", default="int4")
    parser.add_argument("--train", type=Path, default=TRAIN)
    args = parser.parse_args()
    model = load("smollm2-135m", args.weights, 2)
    rows = [json.loads(line) for line in args.train.open()]
    random.Random(0).shuffle(rows)
    writer = SpeculativeDecoder(model, make_drafter("suffix", model, scope="request"), k=5, k_policy="fixed")
    answers = [writer.generate(r["prompt"], max_new_tokens=128).token_ids
               for r in tqdm(rows[: args.answers], desc="answering training prompts")]
    print(f"seed: {len(answers)} answers, {sum(map(len, answers))} tokens")
    sizes = [int(s) for s in args.sizes.split(",")]
    stores = {n: seeded(answers[:n]) for n in sizes}
    questions = [json.loads(line) for line in PACKAGED.open()][::10]
    totals = collections.defaultdict(lambda: [0, 0])
    for row in tqdm(questions, desc="Spec-Bench"):
        for n in sizes:
            drafter = make_drafter("suffix", model, scope="request")
            drafter.store = store = stores[n]
            drafter.reset = lambda *a, **k: None  # keep the seeded store for this request
            out = SpeculativeDecoder(model, drafter, k=5, k_policy="fixed").generate(row["turns"][0], max_new_tokens=128)
            drafter._finish()
            with store.lock:  # the question's own text leaves the store again
                store.tokens -= len(store.sequences.popitem()[1])
                store._rebuild()
            for key in (n, (n, row["category"])):
                totals[key][0] += len(out.token_ids)
                totals[key][1] += out.stats.verify_steps
    for key, (tokens, passes) in sorted(totals.items(), key=str):
        print(f"seed of {key}: {tokens / passes:.3f} tokens a pass")


if __name__ == "__main__":
    main()
