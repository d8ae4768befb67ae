"""The block kernel's look-ahead (``blockmm.set_lookahead``, docs/kernels.md) on whole answers: the code-edit prompts
decoded greedily on the blocks backend, plainly and with suffix drafts (scope ``request``, so a repeated prompt finds
nothing of its earlier answer), with the look-ahead on and off in turn for each prompt (the order swapped every
other prompt). Prints tokens a second per method and setting, and checks each answer is the same either way.

    python experiments/lookahead_decode_ab.py --target qwen2.5-coder-1.5b --rounds 2 --max-new-tokens 128
"""

import argparse
import time

import verispec.blockmm as blockmm
from verispec import SpeculativeDecoder, load_model
from verispec.bench.prompts import NAMED, load_questions, select
from verispec.drafters.suffix import SuffixDrafter


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args()
    target = load_model(args.target, backend="blocks")
    on = blockmm.lookahead()
    print("kernel:", target.linear_kernel)
    prompts = [q.turns[0] for q in select(load_questions(NAMED["code"]), ["code_edit"], args.limit)]
    decoders = {"plain": SpeculativeDecoder(target),
                "suffix": SpeculativeDecoder(target, SuffixDrafter(scope="request"))}
    decoders["plain"].generate(prompts[0], max_new_tokens=8)  # warm-up
    settings = {"look-ahead on": on, "look-ahead off": (0, 0)}
    tokens = {(m, s): 0 for m in decoders for s in settings}
    seconds = dict.fromkeys(tokens, 0.0)
    answers: dict = {}
    for r in range(args.rounds):
        for i, prompt in enumerate(prompts):
            order = list(settings) if (i + r) % 2 == 0 else list(reversed(settings))
            for method, decoder in decoders.items():
                for setting in order:
                    blockmm.set_lookahead(*settings[setting])
                    start = time.perf_counter()
                    out = decoder.generate(prompt, max_new_tokens=args.max_new_tokens)
                    seconds[(method, setting)] += time.perf_counter() - start
                    tokens[(method, setting)] += len(out.token_ids)
                    answers.setdefault((i, method), out.token_ids)
                    assert answers[(i, method)] == out.token_ids, (i, method, setting)
        print(f"round {r} done", flush=True)
    blockmm.set_lookahead(*on)
    for (method, setting), n in tokens.items():
        print(f"  {method:7s} {setting:15s} {n / seconds[(method, setting)]:.2f} tok/s ({n} tokens)")
    print("every answer the same with the look-ahead on and off, plain and with suffix drafts")


if __name__ == "__main__":
    main()
