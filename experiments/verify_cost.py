"""What verifying one-hot drafts costs: the generator rule (``verify``) against the position-keyed rule
(``verify_positional``) on the same rows, with 0, 2 and all k draft tokens accepted; and what greedy verification's
argmax of the target's rows costs (``sampling.greedy_tokens``, numpy, against torch's argmax) at 2 and k + 1 rows.

    python experiments/verify_cost.py [--vocab 49152] [--k 8] [--repeats 300]
"""
import argparse
import statistics
import time

import torch

from verispec.sampling import SamplingParams, greedy_tokens, position_uniform, probabilities, sample_at
from verispec.verify import verify, verify_positional


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=300)
    args = ap.parse_args()
    torch.set_num_threads(1)
    k, vocab = args.k, args.vocab
    gen = torch.Generator().manual_seed(0)
    p = probabilities(torch.randn(k + 1, vocab, generator=gen) * 4, SamplingParams(temperature=0.8, top_p=0.95))
    draws = [sample_at(p[i], position_uniform(1, 100 + i)) for i in range(k + 1)]
    for n in (0, 2, k):  # the first n draft tokens equal the positional draws, the next differs
        draft = [draws[i] if i < n else (draws[i] + 1) % vocab for i in range(k)]
        x = torch.tensor(draft)
        a, b = [], []
        for _ in range(args.repeats):
            t = time.perf_counter()
            verify(x, None, p, gen)
            a.append(time.perf_counter() - t)
            t = time.perf_counter()
            verify_positional(draft, p, 1, 100)
            b.append(time.perf_counter() - t)
        print(f"k={k}, vocabulary {vocab}, {n} accepted: generator rule {1e6 * statistics.median(a):.0f} us, "
              f"position-keyed {1e6 * statistics.median(b):.0f} us")
    for rows in (2, k + 1):
        logits = torch.randn(rows, vocab, generator=gen)
        a, b = [], []
        for _ in range(args.repeats):
            t = time.perf_counter()
            logits.argmax(dim=-1).tolist()
            a.append(time.perf_counter() - t)
            t = time.perf_counter()
            greedy_tokens(logits)
            b.append(time.perf_counter() - t)
        print(f"greedy argmax of {rows} rows: torch {1e6 * statistics.median(a):.0f} us, "
              f"greedy_tokens (numpy) {1e6 * statistics.median(b):.0f} us")


if __name__ == "__main__":
    main()
