"""Medusa drafting with the heads' weights packed for oneDNN against the plain MKL matmuls, in one process,
interleaved per prompt (greedy, the controller choosing k, the target as the CLI loads it by default).

    python experiments/medusa_packing_ab.py --prompts 8 --tokens 128

Prints per-arm tokens/s, draft seconds per proposal and tokens per step, and whether every answer is identical.
"""

import argparse
import json
import time

import torch

from verispec import SpeculativeDecoder, load_model
from verispec.bench.prompts import default_prompts_path, load_questions
from verispec.drafters.medusa import MedusaDrafter
from verispec.medusa.head import MedusaHeads
from verispec.medusa.weights import resolve_heads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--compile", default="auto", choices=["auto", "on", "off"])
    args = ap.parse_args()
    torch.set_num_threads(2)
    target = load_model("smollm2-135m", compiled=args.compile)
    questions = load_questions(default_prompts_path())
    prompts = [q.turns[0] for q in questions[:: max(1, len(questions) // args.prompts)]][: args.prompts]
    folder = resolve_heads(target.name, None)
    packed = MedusaDrafter(target, MedusaHeads.load(folder))
    plain = MedusaDrafter(target, MedusaHeads.load(folder))
    plain.heads = MedusaHeads.load(folder).train().attach(target.embedding_model).eval()  # attached in training: unpacked
    assert packed.heads._lm_head_packed is not None and plain.heads._lm_head_packed is None
    arms = {"plain decoding": SpeculativeDecoder(target), "medusa, MKL": SpeculativeDecoder(target, drafter=plain),
            "medusa, packed": SpeculativeDecoder(target, drafter=packed)}
    for d in arms.values():
        d.generate("Hello", max_new_tokens=8)
    totals = {name: {"tokens": 0, "seconds": 0.0, "draft": 0.0, "steps": 0, "proposals": 0} for name in arms}
    outputs: dict[str, list] = {name: [] for name in arms}
    for i, prompt in enumerate(prompts):
        order = list(arms) if i % 2 == 0 else list(reversed(arms))
        for name in order:
            start = time.perf_counter()
            g = arms[name].generate(prompt, max_new_tokens=args.tokens)
            t = totals[name]
            t["seconds"] += time.perf_counter() - start
            t["tokens"] += len(g.token_ids)
            t["draft"] += g.stats.draft_seconds
            t["steps"] += g.stats.verify_steps
            t["proposals"] += g.stats.drafts
            outputs[name].append(g.token_ids)
    base = totals["plain decoding"]["tokens"] / totals["plain decoding"]["seconds"]
    for name, t in totals.items():
        rate = t["tokens"] / t["seconds"]
        print(json.dumps({"arm": name, "tok_s": round(rate, 1), "vs_plain": round(rate / base, 3),
                          "tokens_per_step": round(t["tokens"] / max(1, t["steps"]), 2),
                          "draft_ms_per_proposal": round(1000 * t["draft"] / max(1, t["proposals"]), 2),
                          "identical_to_plain": outputs[name] == outputs["plain decoding"]}))


if __name__ == "__main__":
    main()
