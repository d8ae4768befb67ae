"""The native block kernel's cost per pass width on a real file's matrices, beside the memory floor.

Every 2-D matrix of the file that a decoding pass multiplies (token_embd counts as the output layer where the file
has no output.weight: tied embeddings) is multiplied at widths w, interleaved (each round times every width once),
and the median round is reported in ms and as c(w) / c(1). The floor is the bytes the pass reads over the read
bandwidth measured here with the same threads (``timing.read_bandwidth``).

    python experiments/blockmm_costs.py --target qwen2.5-coder-1.5b --widths 1,2,4,8,16 --rounds 7

``--wide avx2,vnni256,avx512vnni`` times products of 3 or more rows on each of those instruction sets in the same
rounds (``blockmm.set_wide_isa``), one column each; ``amx`` among them puts the K types' products on the AMX tiles
(``blockmm.set_amx_rows``; CPUs with AMX-INT8 only).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from verispec import blockmm
from verispec.backends.references import gguf_file
from verispec.backends.timing import read_bandwidth


def matrices(path):
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    names = {t.name for t in reader.tensors}
    out = []
    for t in reader.tensors:
        kind = t.tensor_type.name
        if len(t.shape) != 2 or kind not in blockmm.TYPES:
            continue
        if t.name == "token_embd.weight" and "output.weight" in names:
            continue  # an embedding lookup reads one row, not the matrix
        raw = torch.from_numpy(np.ascontiguousarray(np.asarray(t.data).reshape(int(t.shape[1]), -1)))
        out.append((t.name, kind, int(t.shape[0]), raw))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--widths", default="1,2,3,4,5,6,8,10,12,16")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=blockmm.default_threads())
    ap.add_argument("--isa", default=None, help=f"one of {', '.join(blockmm.ISAS)} (default: the CPU's best)")
    ap.add_argument("--wide", default=None, help="instruction sets for 3 or more rows, timed side by side")
    args = ap.parse_args()
    if args.isa:
        blockmm.set_isa(args.isa)
    wide = args.wide.split(",") if args.wide else [blockmm.wide_isa()]
    widths = [int(w) for w in args.widths.split(",")]
    mats = matrices(gguf_file(args.target))
    total = sum(raw.numel() for *_, raw in mats)
    bw = read_bandwidth(args.threads)
    xs = {w: [torch.randn(w, K) for _, _, K, _ in mats] for w in widths}
    ys = {w: [torch.empty(w, raw.shape[0]) for *_, raw in mats] for w in widths}
    runs = [(w, name) for w in widths for name in (wide if w >= 3 else wide[:1])]
    times = {run: [] for run in runs}
    for r in range(args.rounds + 1):
        for w, name in runs:
            blockmm.set_wide_isa(blockmm.isa() if name == "amx" else name)
            if blockmm.amx_usable():
                blockmm.set_amx_rows(1 if name == "amx" else 0)
            t = time.perf_counter()
            for (_, kind, K, raw), x, y in zip(mats, xs[w], ys[w]):
                blockmm.matmul(x, raw, kind, threads=args.threads, out=y)
            if r:
                times[w, name].append(time.perf_counter() - t)
    kinds = sorted({k for _, k, _, _ in mats})
    print(f"{args.target}: {len(mats)} matrices ({', '.join(kinds)}), {total / 1e9:.3f} GB; isa {blockmm.isa()}, "
          f"{args.threads} threads; read bandwidth {bw / 1e9:.1f} GB/s -> floor {total / bw * 1e3:.1f} ms")
    base = statistics.median(times[runs[0]]) * 1e3
    print("| w | " + " | ".join(f"{name} ms (c(w)/c(1))" for name in wide) + " |")
    print("|---:|" + "---:|" * len(wide))
    for w in widths:
        cells = [statistics.median(times[w, name]) * 1e3 if (w, name) in times else None for name in wide]
        print(f"| {w} | " + " | ".join(f"{ms:.1f} ({ms / base:.2f})" if ms else "" for ms in cells) + " |")


if __name__ == "__main__":
    main()
