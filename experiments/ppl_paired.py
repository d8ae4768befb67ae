"""Perplexity of two or more engines on the same held-out tokens, with the paired difference's 95% interval.

    python experiments/ppl_paired.py --target qwen2.5-coder-1.5b [--backends llamacpp,blocks] [--texts 96]

`verispec bench`'s quality columns score 12 Spec-Bench first turns (about 1,300 tokens): enough to catch a broken
format, too few to rank two engines whose perplexities differ by a fraction of a percent. This scores ``--texts``
of them (spread over the six groups, each cut to 256 tokens, each on a fresh cache, teacher-forced as
`verispec.bench.quality` does) on every backend, and gives each engine's perplexity and, against the first backend,
the difference of mean log-likelihood a token with a bootstrap 95% interval over the texts (the texts resampled,
the same ones for both engines: the comparison is paired).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import numpy as np


def per_text_nll(target, token_pieces) -> np.ndarray:
    """Summed negative log-likelihood of each piece's next tokens."""
    import torch

    from verispec.bench.quality import teacher_forced

    out = []
    for ids in token_pieces:
        logprobs = torch.log_softmax(teacher_forced(target, ids)[:-1], dim=-1)
        out.append(-logprobs.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).sum().item())
    return np.array(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--backends", default="llamacpp,blocks")
    ap.add_argument("--texts", type=int, default=96)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--bootstrap", type=int, default=10_000)
    args = ap.parse_args()
    from tqdm import tqdm

    from verispec.backends import load_model
    from verispec.backends.torch_cpu.cpu import cpu_info
    from verispec.bench.quality import held_out_texts, pieces

    backends = args.backends.split(",")
    nll, tokens = {}, None
    for backend in tqdm(backends, desc="engines", unit="engine"):
        model = load_model(args.target, backend=backend, threads=args.threads)
        token_pieces = pieces(model.tokenizer, held_out_texts(args.texts))
        if tokens is None:
            tokens = np.array([len(ids) - 1 for ids in token_pieces])
        nll[backend] = per_text_nll(model, token_pieces)
        del model
    rng = np.random.default_rng(0)
    draws = rng.integers(0, len(tokens), size=(args.bootstrap, len(tokens)))
    first = backends[0]
    print(f"CPU: {cpu_info()['model']}; {args.target}, {len(tokens)} texts, {int(tokens.sum())} tokens scored")
    print(f"| engine | perplexity | mean NLL a token minus {first}'s (95% interval) |")
    print("|---|---:|---|")
    for backend in backends:
        ppl = math.exp(nll[backend].sum() / tokens.sum())
        if backend == first:
            print(f"| {backend} | {ppl:.3f} | |")
            continue
        diff = nll[backend] - nll[first]
        boot = diff[draws].sum(axis=1) / tokens[draws].sum(axis=1)
        lo, hi = np.percentile(boot, [2.5, 97.5])
        print(f"| {backend} | {ppl:.3f} | {diff.sum() / tokens.sum():+.5f} ({lo:+.5f} to {hi:+.5f}) |")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
