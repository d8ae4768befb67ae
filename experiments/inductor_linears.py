"""How fast do inductor's compiled CPU GEMM kernels stream the default model's layer weights, against oneDNN's packed
kernel that verispec uses?

Builds the 30 layers x 7 linears of the default model with random weights (425 MB in float32, no lm_head), compiles
one pass through all of them with ``torch.compile(mode="max-autotune-no-cudagraphs")`` and frozen weights (inductor's
C++ GEMM templates need frozen weights), and times it against the same pass in eager mode (MKL) and with oneDNN's
packed kernel. ``--dynamic`` compiles once for any row count and also reports whether a row's result depends on how
many rows share the pass (what greedy identity between one-token steps and verify passes needs).

    python experiments/inductor_linears.py --rows 1            # a graph for one row
    python experiments/inductor_linears.py --dynamic --rows 1,2,9,17,33
"""

from __future__ import annotations

import argparse
import time

import torch
import torch._inductor.config as inductor_config

from linear_kernels import median_seconds  # experiments/ is on the path when run as a script
from verispec.backends.torch_cpu.cpu import PACK_BATCH_HINT, cpu_info

SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]  # one layer


class Linears(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(i, o, bias=False) for _ in range(30) for o, i in SHAPES)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> list[torch.Tensor]:
        return [layer(a if layer.in_features == 576 else b) for layer in self.layers]


def median_ms(fn, repeats: int = 9) -> float:
    return 1000 * median_seconds(fn, repeats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1", help="rows per matmul (tokens in the pass), comma-separated")
    ap.add_argument("--dynamic", action="store_true", help="one graph for every row count (dynamic=True)")
    args = ap.parse_args()
    inductor_config.freezing = True
    torch.manual_seed(0)
    info = cpu_info()
    print(f"cpu: {info['model']} [{info['torch_capability']}] flags: {' '.join(info['flags'])}; "
          f"{torch.get_num_threads()} threads")
    model = Linears().eval()
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    packed = [torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), PACK_BATCH_HINT) for layer in model.layers]
    rows = [int(r) for r in args.rows.split(",")]
    with torch.no_grad():
        compiled = torch.compile(model, mode="max-autotune-no-cudagraphs", dynamic=args.dynamic)
        for n in rows:
            a, b = torch.randn(1, n, 576), torch.randn(1, n, 1536)
            t0 = time.perf_counter()
            compiled(a, b)
            compile_s = time.perf_counter() - t0

            def onednn():
                for layer, p in zip(model.layers, packed):
                    torch.ops.mkldnn._linear_pointwise(a if layer.in_features == 576 else b, p, None, "none", [], "")

            c, e, o = median_ms(lambda: compiled(a, b)), median_ms(lambda: model(a, b)), median_ms(onednn)
            print(f"rows {n:>2}: first call {compile_s:5.1f} s; compiled {c:.1f} ms ({nbytes / c / 1e6:.1f} GB/s), "
                  f"oneDNN-packed {o:.1f} ms, eager MKL {e:.1f} ms", flush=True)
        if args.dynamic and len(rows) > 1:
            n = max(rows)
            a, b = torch.randn(1, n, 576), torch.randn(1, n, 1536)
            together = compiled(a, b)
            alone = compiled(a[:, :1].contiguous(), b[:, :1].contiguous())
            diff = max(float((x[:, 0] - y[:, 0]).abs().max()) for x, y in zip(alone, together))
            print(f"row 0 alone vs in a {n}-row pass: max difference {diff:.2e}")


if __name__ == "__main__":
    main()
