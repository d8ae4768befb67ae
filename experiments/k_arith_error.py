"""How far the block kernel's K-type float steps land from the exact value of the same integers, on a file's matrices.

For each (type, width) of the file's Q4_K / Q6_K matrices (its first 256 rows), random activations are quantized as
the kernel quantizes them, and the output of ``reference.matmul`` (what every path computes, bit for bit) is compared
with the same integers and factors combined in float64; printed relative to the outputs' mean magnitude. ``--old``
names a copy of an earlier reference.py to compare (e.g. ``git show 2a75c7b:verispec/blockmm/reference.py >
/tmp/ref_old.py``: the eight-lane arithmetic before 2026-12-04).

    python experiments/k_arith_error.py --target qwen2.5-coder-1.5b --old /tmp/ref_old.py
"""

from __future__ import annotations

import argparse
import importlib.util

import torch

from blockmm_costs import matrices
from verispec.backends.references import gguf_file
from verispec.blockmm import reference as R


def exact(x: torch.Tensor, raw: torch.Tensor, kind: str) -> torch.Tensor:
    M, K = x.shape
    G = K // 256
    w, _, _, c = R.unpack(raw, kind, K)
    N = w.shape[0]
    rb = raw.reshape(N, G, -1)
    if kind == "Q6_K":
        d, dmin = R._half(rb[..., 208:210]), torch.zeros(N, G)
        mins = torch.zeros(N, G, 8, dtype=torch.int64)
    else:
        d, dmin = R._half(rb[..., 0:2]), R._half(rb[..., 2:4])
        sc, mins = R._k_scales(rb[..., 4:16])
        c = sc.repeat_interleave(2, dim=-1).reshape(N, K // 16)
    q, dx, bsum = R.quantize_rows(x, 256)
    cw = w * c.repeat_interleave(16, dim=1)
    prod = torch.einsum("mgk,ngk->mng", q.reshape(M, G, 256), cw.reshape(N, G, 256)).double()
    im = torch.einsum("mgj,ngj->mng", bsum.reshape(M, G, 8), mins).double()
    t, u = d.double()[None] * dx.double()[:, None], dmin.double()[None] * dx.double()[:, None]
    return (prod * t - im * u).sum(-1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--old", default=None, help="an earlier reference.py to compare")
    args = ap.parse_args()
    old = None
    if args.old:
        spec = importlib.util.spec_from_file_location("verispec.blockmm.reference_old", args.old)
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
    torch.manual_seed(0)
    seen = set()
    for name, kind, K, raw in matrices(gguf_file(args.target)):
        if kind not in ("Q4_K", "Q5_K", "Q6_K") or (kind, K) in seen:
            continue
        seen.add((kind, K))
        raw = raw[:256].clone()
        x = torch.randn(16, K)
        want = exact(x, raw, kind)
        scale = want.abs().mean()
        line = f"{name} ({kind}, K = {K}): now mean {((R.matmul(x, raw, kind).double() - want).abs().mean() / scale):.3g}"
        line += f" max {((R.matmul(x, raw, kind).double() - want).abs().max() / scale):.3g}"
        if old:
            err = (old.matmul(x, raw, kind).double() - want).abs()
            line += f" | old mean {err.mean() / scale:.3g} max {err.max() / scale:.3g}"
        print(line)


if __name__ == "__main__":
    main()
