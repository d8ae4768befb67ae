"""Would Token Recycling (Luo et al. 2024: a table of each token's top-k successors from the target's own logits) fill
the steps where prompt lookup finds nothing? A simulation on greedy answers, no engine: the default model answers
every 20th Spec-Bench first turn (128 tokens, float32), one full forward gives each position's top-8 next tokens,
and each policy walks the answers step by step, counting tokens committed per target pass (the table learns from
the rows a pass computes; it is kept across answers and seeded from the prompt rows).

    python experiments/token_recycling_sim.py --questions 24 --k 5

Policies: prompt lookup alone (last 3 or 2 tokens matched in the context), then where it finds nothing: a bigram
lookup of the last token in the context (what verispec's padding guesses add on OpenVINO), or a chain from the
recycled table.
"""

import argparse
import torch

from verispec import load_model
from verispec.bench.prompts import load_questions


def answers(count: int) -> list[tuple[list[int], int, list[list[int]]]]:
    target = load_model("smollm2-135m", pack=False)
    model, tok = target.model, target.tokenizer
    questions = load_questions()[::20][:count]
    out = []
    for q in questions:
        ids = tok.apply_chat_template([{"role": "user", "content": q.turns[0]}], add_generation_prompt=True,
                                      tokenize=True, return_dict=True, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            seq = model.generate(ids, max_new_tokens=128, do_sample=False)
            top = model(seq).logits[0].topk(8, dim=-1).indices
        out.append((seq[0].tolist(), ids.shape[1], top.tolist()))
    return out


def lookup(ctx: list[int], k: int, sizes=(3, 2)) -> list[int]:
    for n in sizes:
        key = ctx[-n:]
        for i in range(len(ctx) - n - 1, -1, -1):
            if ctx[i : i + n] == key:
                return ctx[i + n : i + n + k]
    return []


def recycled(table: dict, token: int, k: int) -> list[int]:
    out = []
    while len(out) < k and token in table:
        token = table[token][0]
        out.append(token)
    return out


def tokens_per_step(seqs, k: int, fallback: str, kf: int) -> float:
    table: dict[int, list[int]] = {}
    steps = tokens = 0
    for seq, plen, top in seqs:
        for s in range(plen):
            table[seq[s]] = top[s]
        t, end = plen, len(seq)
        while t < end - 1:
            ctx = seq[: t + 1]
            draft = lookup(ctx, k)
            if not draft and fallback == "bigram":
                draft = lookup(ctx, kf, sizes=(1,))
            elif not draft and fallback == "recycled":
                draft = recycled(table, seq[t], kf)
            accepted = 0
            while accepted < len(draft) and t + 1 + accepted < end and draft[accepted] == seq[t + 1 + accepted]:
                accepted += 1
            for s in range(t, min(t + accepted + 1, end)):
                table[seq[s]] = top[s]
            steps += 1
            tokens += accepted + 1
            t += accepted + 1
    return tokens / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--questions", type=int, default=24)
    ap.add_argument("--k", type=int, default=5, help="prompt lookup's draft length")
    args = ap.parse_args()
    seqs = answers(args.questions)
    for fallback in ("none", "bigram", "recycled"):
        for kf in (1, 3):
            print(f"lookup k={args.k}, where it finds nothing: {fallback:8s} up to {kf}: "
                  f"{tokens_per_step(seqs, args.k, fallback, kf):.3f} tokens a step", flush=True)


if __name__ == "__main__":
    main()
