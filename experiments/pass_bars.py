"""Issue 32's pass bars on this CPU, in float32 (the default dtype): a one-token step against the bandwidth floor
(weight bytes / measured read bandwidth), and a 9-token pass against a one-token step, for the compiled PyTorch
engine (the stored step and verify programs, ``compiled="on"``) and OpenVINO's fp32 graphs (static widths 2, 9 and
10; one-token steps padded to 2 as by default; a 9-token pass either on a graph of its own or padded to 10 as
``static_widths="auto"`` runs it).

    python experiments/pass_bars.py                    # both engines, passes interleaved in one process
    python experiments/pass_bars.py --engines openvino # one engine alone (the other's threads do not compete)

Each pass runs after --context cached positions; passes of every engine and width take turns in each round with a
read of 512 MB (a sum: the read bandwidth, which moved between 27 and 52 GB/s within minutes on a 2-core cloud
Zen 4), so that the floor is measured in the same moments as the passes (an untimed one-token pass of each engine
follows the read); the first round dropped; medians.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from verispec import load_model
from verispec.backends.torch_cpu.cpu import cpu_info

CELLS = {"pytorch": (1, 9), "openvino": (1, 9, 10)}




def load(engine: str):
    if engine == "pytorch":
        model = load_model("smollm2-135m", compiled="on")
        while getattr(model, "programs_loading", False):  # the verify program loads in the background
            time.sleep(0.1)
        return model
    model = load_model("smollm2-135m", backend="openvino", weights="fp32", static_widths=(2, 9, 10))
    model.prepare()
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default="pytorch,openvino")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--context", type=int, default=300)
    args = ap.parse_args()
    engines = args.engines.split(",")
    if unknown := set(engines) - set(CELLS):
        ap.error(f"unknown engines {sorted(unknown)}; choose from {', '.join(CELLS)}")
    info = cpu_info()
    print(f"cpu: {info['model']} [{info['torch_capability']}]; {torch.get_num_threads()} threads", flush=True)
    runs = {}
    for engine in engines:
        model = load(engine)
        kv = model.new_kv()
        model.forward(kv, [(7 * i) % model.vocab_size for i in range(args.context)], last_only=True)
        runs[engine] = model, kv
    times = {(e, w): [] for e in engines for w in CELLS[e]}
    big, reads = torch.ones(128 * 1024 * 1024), []  # 512 MB
    for r in range(args.rounds + 1):
        t0 = time.perf_counter()
        big.sum()
        if r:
            reads.append(big.numel() * 4 / (time.perf_counter() - t0))
        for model, kv in runs.values():  # untimed: each engine's threads awake again after the read
            model.forward(kv, [r % model.vocab_size])
            kv.truncate(args.context)
        for engine, width in times:
            model, kv = runs[engine]
            tokens = [(11 * i + r) % model.vocab_size for i in range(width)]
            t0 = time.perf_counter()
            model.forward(kv, tokens)
            elapsed = time.perf_counter() - t0
            kv.truncate(args.context)
            if r:
                times[engine, width].append(1000 * elapsed)
    nbytes = sum(p.numel() for p in load_model("smollm2-135m").model.parameters()) * 4
    bandwidth = statistics.median(reads)
    floor = 1000 * nbytes / bandwidth
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s (median; {min(reads) / 1e9:.1f}-{max(reads) / 1e9:.1f}); "
          f"{nbytes / 1e6:.0f} MB of float32 weights: floor {floor:.2f} ms a step")
    for engine in engines:
        ms = {w: statistics.median(times[engine, w]) for w in CELLS[engine]}
        wide = ", ".join(f"{w} tokens {ms[w]:.2f} ms ({ms[w] / ms[1]:.2f}x a step)" for w in CELLS[engine][1:])
        print(f"{engine}: step {ms[1]:.2f} ms ({ms[1] / floor:.2f}x the floor); {wide}", flush=True)


if __name__ == "__main__":
    main()
