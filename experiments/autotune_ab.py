"""What inductor's autotuning buys the compiled passes: the default model's one-token step and verify program built
with it (``verispec compile``, the default) against the same built without it (``VERISPEC_COMPILE_AUTOTUNE=0``),
pass costs by width after 300 cached tokens (median of ``--rounds``, the two interleaved), then greedy decoding of
Spec-Bench first turns, plain and with n-gram drafts, each load against its own plain decoding (identity) and the two
against each other.

    VERISPEC_COMPILE_AUTOTUNE=0 VERISPEC_CACHE=/tmp/untuned verispec compile   # build the second pair first
    python experiments/autotune_ab.py --untuned-cache /tmp/untuned [--widths 1,2,3,5,9,12] [--prompts 6]

(/tmp/untuned needs the model: link its ``models`` folder to the default cache's.)
"""

import argparse
import os
import statistics
import time

import torch

from verispec import NgramDrafter, SpeculativeDecoder, load_model
from verispec.backends.torch_cpu.compile_store import AUTOTUNE_ENV
from verispec.bench.prompts import load_questions


def load(cache: str | None):
    """The default model with its stored step and verify program: the default cache's (autotuned), or ``cache``'s
    (built without autotuning, which is part of the packages' key)."""
    saved = {k: os.environ.get(k) for k in ("VERISPEC_CACHE", AUTOTUNE_ENV)}
    if cache:
        os.environ.update({"VERISPEC_CACHE": cache, AUTOTUNE_ENV: "0"})
    try:
        model = load_model("smollm2-135m", compiled="auto")
        model.wait_compiled()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    assert model.step is not None and model.verify is not None, f"nothing stored under {cache or 'the default cache'}"
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--untuned-cache", required=True)
    parser.add_argument("--widths", default="1,2,3,5,9,12")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=96)
    args = parser.parse_args()
    models = {"tuned": load(None), "untuned": load(args.untuned_cache)}
    widths = [int(w) for w in args.widths.split(",")]
    vocab = models["tuned"].vocab_size
    kvs = {name: m.new_kv() for name, m in models.items()}
    times = {(name, w): [] for name in models for w in widths}
    with torch.inference_mode():
        for name, m in models.items():
            m.forward(kvs[name], [(7 * i) % vocab for i in range(300)], last_only=True)
        for r in range(args.rounds + 1):
            for w in widths:
                for name in (list(models) if r % 2 else list(models)[::-1]):
                    kv = kvs[name]
                    t0 = time.perf_counter()
                    models[name].forward(kv, [(11 * i + r) % vocab for i in range(w)])
                    if r:
                        times[name, w].append(time.perf_counter() - t0)
                    kv.truncate(300)
    print(f"pass ms after 300 cached tokens, median of {args.rounds}:")
    print("width | " + " | ".join(models) + " | untuned / tuned")
    for w in widths:
        t = {name: statistics.median(times[name, w]) * 1e3 for name in models}
        print(f"{w} | " + " | ".join(f"{t[n]:.1f}" for n in models) + f" | {t['untuned'] / t['tuned']:.2f}")
    questions = load_questions(None)
    prompts = [q.turns[0] for q in questions[:: max(1, len(questions) // args.prompts)]][: args.prompts]
    tok = {(name, d): [0, 0.0] for name in models for d in ("plain", "ngram")}
    outs = {}
    for p in prompts:
        for name, m in models.items():
            for d in ("plain", "ngram"):
                decoder = SpeculativeDecoder(m, NgramDrafter() if d == "ngram" else None)
                t0 = time.perf_counter()
                out = decoder.generate(p, max_new_tokens=args.tokens)
                tok[name, d][0] += len(out.token_ids)
                tok[name, d][1] += time.perf_counter() - t0
                outs[name, d, p] = out.token_ids
    for (name, d), (n, s) in tok.items():
        print(f"{name} {d}: {n / s:.1f} tok/s")
    for name in models:
        same = sum(outs[name, "plain", p] == outs[name, "ngram", p] for p in prompts)
        print(f"{name}: n-gram equals its plain decoding on {same}/{len(prompts)}")
    same = sum(outs["tuned", "plain", p] == outs["untuned", "plain", p] for p in prompts)
    print(f"plain, tuned equals untuned on {same}/{len(prompts)}")


if __name__ == "__main__":
    main()
