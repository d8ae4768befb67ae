"""A trained head (EAGLE or Medusa) drafting in float32 against bfloat16 under the float32 target: tokens/s, tokens
per step and the drafter's own milliseconds per step, the two interleaved per round on 12 Spec-Bench first turns
(every 40th question, 128 tokens, end of sequence ignored).

    python experiments/head_dtype.py --drafter eagle --policy fixed --k 8 --rounds 2
"""

import argparse
import json

from verispec import SpeculativeDecoder, make_drafter
from verispec.backends import load_model
from verispec.backends.torch_cpu.cpu import bfloat16_dot_products, cpu_info
from verispec.bench.prompts import PACKAGED


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafter", default="eagle", choices=("eagle", "medusa"))
    ap.add_argument("--policy", default="fixed", choices=("fixed", "cost"))
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    rows = [json.loads(line) for line in PACKAGED.open()]
    texts = [r["turns"][0] for r in rows[::40][:12]]
    target = load_model("smollm2-135m")
    target.eos_token_ids = frozenset()
    info = cpu_info()
    print(f"CPU {info['model']}, bfloat16 dot products: {bfloat16_dot_products()}")
    decoders = {dtype: SpeculativeDecoder(target, make_drafter(args.drafter, target, precision=dtype), k=args.k,
                                          k_policy=args.policy) for dtype in ("float32", "bfloat16")}
    for _ in range(args.rounds):
        for dtype, decoder in decoders.items():
            tokens = steps = drafted = accepted = 0
            draft = wall = 0.0
            for text in texts:
                stats = decoder.generate(text, max_new_tokens=128).stats
                tokens += stats.new_tokens
                steps += stats.verify_steps
                drafted += stats.drafted
                accepted += stats.accepted
                draft += stats.draft_seconds
                wall += stats.wall_seconds
            print(f"{args.drafter} head {dtype}: {tokens / wall:.1f} tok/s, {tokens / steps:.2f} tokens a step, "
                  f"{drafted / steps:.2f} drafted a step ({accepted / max(1, drafted):.1%} accepted), "
                  f"{1e3 * draft / steps:.2f} ms drafting a step", flush=True)


if __name__ == "__main__":
    main()
