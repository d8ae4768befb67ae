"""The block kernel's products beside the best existing int8 kernel on this CPU (FBGEMM, through torch's dynamic
int8 linear) and the memory floor, with the blocks backend's whole pass beside them: every product a pass of the
model makes, at each width, interleaved round by round. Answers "which binds, the memory or the arithmetic" for the
products (no attention, no framework), the question issue 80's bars on c(8) and c(16) come down to.

The block kernel's products are the loaded blocks backend's own matrices (its layouts, its joined q/k/v and gate/up,
each linked to the next as loaded), recorded in the order one pass calls them. FBGEMM gets the same shapes as int8
weights (random values: the timing does not depend on them; 8 bits a weight where the file's are 4.5-6.6, so it reads
more bytes). Both on the same threads. The whole pass is the backend's own, after --context cached tokens.

    python experiments/fbgemm_side_by_side.py [--target qwen2.5-coder-1.5b] [--widths 1,2,4,8,16] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from verispec import blockmm
from verispec.backends import load_model
from verispec.backends.hf.layers import decoder_layers
from verispec.backends.timing import read_bandwidth


def pass_products(model) -> list[blockmm.Matrix]:
    """The matrices a pass multiplies by, in order (the layers' native fronts off while recording: they call the same
    matrices from C++)."""
    leans = [layer.__dict__.get("forward") for layer in decoder_layers(model.model)]
    fronts = [getattr(lean, "front", None) for lean in leans]
    called, call = [], blockmm.Matrix.__call__

    def record(self, x):
        called.append(self)
        return call(self, x)

    for lean in leans:
        if lean is not None:
            lean.front = None
    blockmm.Matrix.__call__ = record
    try:
        kv = model.new_kv()
        model.forward(kv, [1, 2, 3])
    finally:
        blockmm.Matrix.__call__ = call
        for lean, front in zip(leans, fronts):
            if lean is not None:
                lean.front = front
    return called


def fbgemm_linear(N: int, K: int) -> torch.nn.Module:
    linear = torch.nn.Linear(K, N, bias=False)
    with torch.no_grad():
        linear.weight.uniform_(-0.05, 0.05)
    return torch.ao.quantization.quantize_dynamic(torch.nn.Sequential(linear), {torch.nn.Linear}, dtype=torch.qint8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--widths", default="1,2,4,8,16")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--threads", type=int, default=blockmm.default_threads())
    args = ap.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    torch.set_num_threads(args.threads)
    torch.backends.quantized.engine = "fbgemm"
    model = load_model(args.target, backend="blocks", threads=args.threads)
    ours = pass_products(model)
    theirs = [fbgemm_linear(m.N, m.K) for m in ours]
    file_bytes = sum(m.blocks.numel() for m in ours)
    macs = int8_bytes = sum(m.N * m.K for m in ours)  # one int8 byte a weight
    kv = model.new_kv()
    model.forward(kv, [(7 * i) % 1000 for i in range(args.context)], last_only=True)

    def whole(width: int) -> None:
        model.forward(kv, [(11 * i + 5) % 1000 for i in range(width)])
        kv.truncate(args.context)

    xs = {w: [torch.randn(w, m.K) for m in ours] for w in widths}
    runs = {"blocks backend, whole pass": whole,
            "blocks products": lambda w: [m(x) for m, x in zip(ours, xs[w])],
            "FBGEMM int8 products": lambda w: [m(x) for m, x in zip(theirs, xs[w])]}
    times = {(name, w): [] for name in runs for w in widths}
    with torch.inference_mode():
        for r in range(args.rounds + 1):  # round 0 warms up
            for w in widths:
                for name, run in runs.items():
                    time.sleep(0.2)  # the other engine's threads stop spinning (OpenMP's wait, the pool's) first
                    t = time.perf_counter()
                    run(w)
                    if r:
                        times[name, w].append(time.perf_counter() - t)
    bw = read_bandwidth(args.threads)
    print(f"{args.target}: {len(ours)} products a pass; {args.threads} threads; {blockmm.isa()}; read bandwidth "
          f"{bw / 1e9:.1f} GB/s: the file's {file_bytes / 1e9:.3f} GB {file_bytes / bw * 1e3:.1f} ms, as int8 "
          f"{int8_bytes / 1e9:.3f} GB {int8_bytes / bw * 1e3:.1f} ms")
    print("| ms (c(w) / c(1)) | " + " | ".join(f"w = {w}" for w in widths) + " |")
    print("|---|" + "---:|" * len(widths))
    for name in runs:
        base = statistics.median(times[name, widths[0]]) * 1e3
        cells = []
        for w in widths:
            ms = statistics.median(times[name, w]) * 1e3
            cells.append(f"{ms:.1f}" if w == widths[0] else f"{ms:.1f} ({ms / base:.2f})")
        print(f"| {name} | " + " | ".join(cells) + " |")
    print("GMAC/s of the products: " + ", ".join(
        f"w={w}: blocks {macs * w / statistics.median(times['blocks products', w]) / 1e9:.0f}, FBGEMM "
        f"{macs * w / statistics.median(times['FBGEMM int8 products', w]) / 1e9:.0f}" for w in widths))


if __name__ == "__main__":
    main()
