"""What one sample of the real-model audit (``verispec.audit.run_audit``: a 3-token sampled generation and the exact
distributions it is tested against) costs on each engine, per drafter: the default model's audits in the test suite
run on the engine that costs least a sample (docs/testing.md). Run it on one core (``taskset -c 0``), as a test
worker runs.

    taskset -c 0 python experiments/audit_speed.py [--backends transformers,blocks] [--drafters ngram,eagle]
"""

import argparse
import time

import torch

from verispec import SpeculativeDecoder, load_model, make_drafter
from verispec.audit import run_audit


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--backends", default="transformers,blocks")
    ap.add_argument("--drafters", default="ngram,eagle")
    ap.add_argument("--samples", type=int, default=40)
    args = ap.parse_args()
    torch.set_num_threads(1)
    for backend in args.backends.split(","):
        model = load_model(args.target, backend=backend, threads=1)
        for name in args.drafters.split(","):
            decoder = SpeculativeDecoder(model, make_drafter(name, target=model), k=4, k_policy="fixed")
            ids = decoder.encode("Write a short poem about the sea.")
            run_audit(decoder, ids, temperature=1.0, samples=10, positions=3, seed=0)  # warm up
            t0 = time.perf_counter()
            run_audit(decoder, ids, temperature=1.0, samples=args.samples, positions=3, seed=100)
            took = (time.perf_counter() - t0) / args.samples * 1e3
            print(f"{backend} ({model.kernel}), {name}: {took:.0f} ms a sample", flush=True)


if __name__ == "__main__":
    main()
