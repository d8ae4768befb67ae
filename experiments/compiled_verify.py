"""Compiled verify passes against eager ones, beside the compiled one-token step (docs/results-archive.md, 2026-11-27 15:15
UTC).

    python experiments/compiled_verify.py [--prompts 12] [--tokens 128] [--drafters none,ngram,eagle] [--widths 1,2,5,9,17]

First the pass cost by width after 300 cached tokens (median of 9, interleaved): the compiled program against the
eager pass over the same fixed cache. Then two loads of the default model, both with the compiled one-token step:
"verify compiled" (the default since 2026-11-27) and "verify eager" (VERISPEC_COMPILED_VERIFY=0, what ran before),
decoding Spec-Bench first turns (greedy, the controller) with each drafter, interleaved per prompt. Prints tok/s, tokens
a step and how many answers equal the compiled plain decoding's.
"""

import argparse
import os
import statistics
import time

import torch

from verispec import SpeculativeDecoder, load_model
from verispec.backends.hf import COMPILED_VERIFY_ENV
from verispec.bench.prompts import load_questions
from verispec.drafters.registry import make_drafter


def pass_costs(model, widths: list[int], rounds: int = 9, context: int = 300) -> None:
    vocab = model.vocab_size
    kv = model.new_kv()
    with torch.inference_mode():
        model.forward(kv, [(7 * i) % vocab for i in range(context)], last_only=True)
        verify, times = model.verify, {(w, how): [] for w in widths for how in ("compiled", "eager")}
        for r in range(rounds + 1):
            for w in widths:
                for how in ("compiled", "eager"):
                    model.verify = verify if how == "compiled" else None
                    if w == 1 and how == "eager":
                        step, model.step = model.step, None
                    t0 = time.perf_counter()
                    model.forward(kv, [(11 * i + r) % vocab for i in range(w)])
                    if r:
                        times[w, how].append(1000 * (time.perf_counter() - t0))
                    if w == 1 and how == "eager":
                        model.step = step
                    kv.truncate(context)
        model.verify = verify
    print("| pass width | " + " | ".join(str(w) for w in widths) + " |")
    print("|---|" + "---|" * len(widths))
    for how in ("compiled", "eager"):
        print(f"| {how}, ms | " + " | ".join(f"{statistics.median(times[w, how]):.1f}" for w in widths) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=12, help="Spec-Bench first turns, spread over the groups")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--drafters", default="none,ngram,eagle")
    ap.add_argument("--widths", default="1,2,5,9,17")
    args = ap.parse_args()
    fast = load_model("smollm2-135m", compiled="on")
    os.environ[COMPILED_VERIFY_ENV] = "0"
    try:
        before = load_model("smollm2-135m", compiled="on")
    finally:
        del os.environ[COMPILED_VERIFY_ENV]
    assert fast.verify is not None and before.verify is None and before.step is not None
    print(f"compiled verify program: widths {fast.verify.widths[0]}-{fast.verify.widths[1]}")
    pass_costs(fast, [int(w) for w in args.widths.split(",")])
    questions = load_questions(None)
    step = max(1, len(questions) // args.prompts)
    texts = [q.turns[0] for q in questions[::step][: args.prompts]]
    targets = {"verify compiled": fast, "verify eager": before}
    decoders = {}
    for drafter in args.drafters.split(","):
        for label, target in targets.items():
            # suffix drafts from this request's text only: with the process's store the second decoder of a prompt
            # would copy the first one's answer
            d = make_drafter(drafter, target, **({"scope": "request"} if drafter == "suffix" else {}))
            decoders[drafter, label] = SpeculativeDecoder(target, d)
            decoders[drafter, label].generate(texts[0], max_new_tokens=16)  # warm-up
    runs = {key: [] for key in decoders}
    for text in texts:
        for key, decoder in decoders.items():
            t0 = time.perf_counter()
            out = decoder.generate(text, max_new_tokens=args.tokens)
            runs[key].append((out, time.perf_counter() - t0))
    reference = [out.token_ids for out, _ in runs["none", "verify compiled"]]
    print("| drafter | verify passes | tok/s | tokens a step | same as compiled plain |")
    print("|---|---|---:|---:|---:|")
    for (drafter, label), outs in runs.items():
        tokens = sum(len(o.token_ids) for o, _ in outs)
        seconds = sum(s for _, s in outs)
        steps = sum(o.stats.verify_steps for o, _ in outs)
        same = sum(o.token_ids == r for (o, _), r in zip(outs, reference))
        print(f"| {drafter} | {label} | {tokens / seconds:.1f} | {tokens / max(steps, 1):.2f} | {same}/{len(outs)} |",
              flush=True)


if __name__ == "__main__":
    main()
