"""How often do greedy outputs with prepacked float32 weights differ from transformers' own generate on plain weights?

Packed float32 linears (verispec.backends.torch_cpu.packing) differ from MKL's in the last bits, so a near-tie can flip a greedy token.
This loads the model twice (packed and plain), decodes the first turn of Spec-Bench questions greedily and compares,
token for token: verispec plain decoding (packed) against transformers' ``generate`` (plain weights), and the n-gram
drafter against plain decoding on the same packed weights (the guarantee).

    python experiments/kernel_identity.py --limit 5 --max-new-tokens 128
"""

import argparse

import torch
from tqdm import tqdm

from verispec import NgramDrafter, SpeculativeDecoder, load_model
from verispec.bench.prompts import load_questions, select


def first_difference(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=5, help="questions per Spec-Bench group (default: 5)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args()
    packed = load_model("smollm2-135m", dtype="float32", pack=True)
    plain = load_model("smollm2-135m", dtype="float32", pack=False)
    assert packed.packed_layers and not plain.packed_layers
    base, spec = SpeculativeDecoder(packed), SpeculativeDecoder(packed, NgramDrafter(), k=8)
    reference = SpeculativeDecoder(plain)
    counts = {"packed plain == transformers generate (plain weights)": 0,
              "plain weights, verispec plain == transformers generate": 0,
              "packed ngram == packed plain": 0}
    diverged = []
    questions = select(load_questions(), limit=args.limit)
    for q in tqdm(questions, desc="greedy identity", unit="question"):
        out = base.generate(q.turns[0], max_new_tokens=args.max_new_tokens)
        ids = torch.tensor([out.prompt_token_ids])
        with torch.inference_mode():
            hf = plain.model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)[0, ids.shape[1]:]
        hf = hf.tolist()
        ref = reference.generate(q.turns[0], max_new_tokens=args.max_new_tokens).token_ids
        fast = spec.generate(q.turns[0], max_new_tokens=args.max_new_tokens).token_ids
        keys = list(counts)
        counts[keys[0]] += out.token_ids == hf
        counts[keys[1]] += ref == hf
        counts[keys[2]] += fast == out.token_ids
        if out.token_ids != hf:
            diverged.append((q.category, first_difference(out.token_ids, hf), len(out.token_ids)))
    for key, n in counts.items():
        print(f"{key}: {n} / {len(questions)}")
    for category, at, length in diverged:
        print(f"  differs from transformers: {category}, first at token {at} of {length}")


if __name__ == "__main__":
    main()
