"""Which linear kernel streams the default model's weights fastest on this CPU, at decoding's row counts?

Builds random weights of the default model's linear shapes (30 layers x q, k, v, o, gate, up, down, and the 49152 x
576 lm_head: 538 MB in float32, far more than any L3 cache, so every pass streams them from memory as decoding does)
and times one pass through all of them with F.linear (MKL for float32) and with oneDNN's prepacked kernel, where this
CPU runs it. Also measures the memory read bandwidth, the floor for one decoding step (weight bytes / bandwidth).

    python experiments/linear_kernels.py --rows 1,9,17,33 --dtypes float32,bfloat16
"""

import argparse
import statistics
import time

import torch

from verispec.backends.torch_cpu.cpu import PACK_BATCH_HINT, cpu_info, packed_linear_works

SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]  # one layer


def median_seconds(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,9,17,33", help="rows per matmul (tokens in the pass)")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    info = cpu_info()
    print(f"cpu: {info['model']} [{info['torch_capability']}] flags: {' '.join(info['flags'])}; "
          f"{torch.get_num_threads()} threads")
    big = torch.ones(128 * 1024 * 1024)  # 512 MB
    with torch.inference_mode():
        seconds = median_seconds(big.sum, args.repeats)
    bandwidth = big.numel() * 4 / seconds
    del big
    print(f"memory read bandwidth: {bandwidth / 1e9:.1f} GB/s")
    gen = torch.Generator().manual_seed(0)
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        weights = [torch.randn(o, i, generator=gen).to(dtype) for _ in range(30) for o, i in SHAPES]
        weights.append(torch.randn(49152, 576, generator=gen).to(dtype))
        nbytes = sum(w.numel() * w.element_size() for w in weights)
        print(f"{name}: {nbytes / 1e6:.0f} MB of weights, floor {1000 * nbytes / bandwidth:.1f} ms per pass")
        packed = ([torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH_HINT) for w in weights]
                  if packed_linear_works(dtype) else None)
        for rows in (int(r) for r in args.rows.split(",")):
            xs = {n: torch.randn(1, rows, n, generator=gen).to(dtype) for n in (576, 1536)}

            def plain():
                for w in weights:
                    torch.nn.functional.linear(xs[w.shape[1]], w)

            def onednn():
                for w, p in zip(weights, packed):
                    torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")

            with torch.inference_mode():
                a = median_seconds(plain, args.repeats)
                cells = f"F.linear {1000 * a:.1f} ms ({nbytes / a / 1e9:.1f} GB/s)"
                if packed is not None:
                    b = median_seconds(onednn, args.repeats)
                    cells += f", oneDNN-packed {1000 * b:.1f} ms ({nbytes / b / 1e9:.1f} GB/s)"
                else:
                    cells += ", oneDNN-packed: not supported by this CPU"
            print(f"  {rows:>3} rows: {cells}", flush=True)


if __name__ == "__main__":
    main()
