"""Teacher-forced top-1 and beta per draft depth of several EAGLE heads on the same cached validation answers.

    python experiments/compare_heads.py --data data/eagle --heads heads/round1,heads/smollm2-135m \
        --split random --skip-first 2400

--split hash is the split train-eagle uses now; --split random is the seeded random sample of 64 it used before
(the shipped head's round 2). --skip-first N drops the first N cached answers (those an earlier round trained on).
Token-only data (train-eagle --features online) works too: the target is run over the validation answers.

--held-out-by PROMPTS:COUNT keeps only the validation answers that a head trained on another data set also held
out: that set answered every prompt of PROMPTS that train-eagle selects (at most 320 tokens) and held out the COUNT
whose prompts hash lowest (how the shipped head's round f was split: data/train-prompts/train_prompts.jsonl:256).
"""

import argparse
import json
import random

import torch

from verispec import load_model
from verispec.training.data import Sequence, load_meta, load_sequences, read_prompts, select_prompts
from verispec.eagle.head import EagleHead
from verispec.eagle.train import TrainConfig, validate, validation_split


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="train-eagle's --data folder")
    ap.add_argument("--heads", required=True, help="comma-separated head folders")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--split", choices=["hash", "random"], default="hash")
    ap.add_argument("--count", type=int, default=64, help="validation answers before --skip-first (default: 64)")
    ap.add_argument("--skip-first", type=int, default=0, help="leave out the first N cached answers")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--held-out-by", metavar="PROMPTS:COUNT",
                    help="keep only answers another data set over all of PROMPTS held out too (see above)")
    args = ap.parse_args()

    sequences = list(load_sequences(args.data))
    if args.split == "hash":
        held = {id(s) for s in validation_split(sequences, args.count, args.seed)[1]}
        indices = [i for i, s in enumerate(sequences) if id(s) in held]
    else:
        indices = random.Random(args.seed).sample(range(len(sequences)), args.count)
    val = [sequences[i] for i in indices if i >= args.skip_first]
    target = load_model(args.target, dtype="float32")
    if args.held_out_by:
        path, _, count = args.held_out_by.rpartition(":")
        prompts = select_prompts(target, read_prompts(path), 10**9, 320, args.seed)
        others = [Sequence(torch.tensor(ids), len(ids), None) for ids in prompts]
        held_there = {tuple(s.tokens.tolist()) for s in validation_split(others, int(count), args.seed)[1]}
        val = [s for s in val if tuple(s.tokens[: s.answer_start].tolist()) in held_there]
        print(f"{len(prompts)} prompts in {path}; kept the answers to its {count} held-out ones")
    answer_tokens = sum(len(s.tokens) - s.answer_start for s in val)
    print(f"{len(val)} validation answers ({answer_tokens} answer tokens)")
    full_head = target.model.get_output_embeddings().weight.detach().float()
    meta = load_meta(args.data)
    cached = list(meta["layers"]) + [target.model.config.num_hidden_layers]  # as stored
    for folder in args.heads.split(","):
        head = EagleHead.load(folder).attach(target.model)
        head.lm_head_d = head.lm_head_d.float()
        layers = list(head.config.feature_layers)
        if meta.get("features", True):  # cached features: pick the head's layers among the stored ones
            scores = validate(head, val, TrainConfig(), full_head, [cached.index(i) for i in layers])
        else:  # token-only data: the target runs over the answers here (teacher forcing)
            scores = validate(head, val, TrainConfig(), full_head, model=target.model, layers=layers)
        print(folder, json.dumps(scores), flush=True)


if __name__ == "__main__":
    main()
