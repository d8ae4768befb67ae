"""Tokens/s and tokens per step of one drafter at a fixed draft length on 12 Spec-Bench first turns (every 40th
question, 128 tokens, end of sequence ignored), on any backend: for A/B runs of one change, interleaved by hand.

    python experiments/drafter_rate.py --backend openvino --weights int4 --drafter eagle --k 5
"""

import argparse
import json
import time

from verispec import SpeculativeDecoder, make_drafter
from verispec.backends import load_model
from verispec.bench.prompts import PACKAGED


def decode_rate(decoder, texts: list[str], max_new_tokens: int = 128) -> tuple[float, float]:
    """(tokens/s, tokens per step) of ``decoder`` over ``texts``, one after another."""
    tokens = steps = 0
    t0 = time.perf_counter()
    for text in texts:
        out = decoder.generate(text, max_new_tokens=max_new_tokens)
        tokens += len(out.token_ids)
        steps += out.stats.verify_steps
    return tokens / (time.perf_counter() - t0), tokens / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="transformers")
    ap.add_argument("--weights", default=None)
    ap.add_argument("--drafter", default="ngram")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    rows = [json.loads(line) for line in PACKAGED.open()]
    texts = [r["turns"][0] for r in rows[::40][:12]]
    options = {"weights": args.weights} if args.weights else {}
    target = load_model("smollm2-135m", backend=args.backend, threads=args.threads, **options)
    target.eos_token_ids = frozenset()
    decoder = SpeculativeDecoder(target, make_drafter(args.drafter, target), k=args.k, k_policy="fixed")
    rate, per_step = decode_rate(decoder, texts)
    print(f"{args.drafter} on {target.kernel}: {rate:.1f} tok/s, {per_step:.3f} tokens per step")


if __name__ == "__main__":
    main()
