"""Could a hand-written float32 kernel beat oneDNN's packed linear at decoding's row counts? (issue 32; docs/kernels.md)

Builds (torch's C++ extension loader, g++, AVX-512F; ~30 s) a plain blocked kernel: weights packed once into blocks of
64 output columns laid out K-major, each block's 4 x 16 columns accumulated in registers for up to 6 rows at a time,
one fused multiply-add per weight vector and row, in the same order of K at every row count, so a row's result does
not depend on how many rows share the call (checked below). Threads split the column blocks (torch's pool). Then
times one pass through the default model's 211 linear shapes (538 MB, streamed from memory as decoding does) with
it and with oneDNN's packed kernel, interleaved. Last, the arithmetic peak for scale: GFLOP/s of a compute-bound
matmul whose operands stay in cache (256 x 576 by 576 x 1536, oneDNN), in float32 and bfloat16.

    python experiments/skinny_linear.py --rows 1,2,5,9,17
"""

import argparse
import statistics
import time

import torch
from torch.utils.cpp_extension import load_inline

from verispec.backends.torch_cpu.cpu import PACK_BATCH_HINT, cpu_info

SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]  # one layer

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

torch::Tensor pack(torch::Tensor w) {  // [N, K] -> [N / 64, K, 64]
  auto N = w.size(0), K = w.size(1);
  TORCH_CHECK(N % 64 == 0, "N must divide by 64");
  return w.view({N / 64, 64, K}).transpose(1, 2).contiguous();
}

template <int M>
static inline void tile(const float* x, int64_t K, const float* wp, float* y, int64_t N, int64_t n0) {
  __m512 a[M][4];
  for (int m = 0; m < M; ++m) for (int j = 0; j < 4; ++j) a[m][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const float* wk = wp + k * 64;
    __m512 w0 = _mm512_loadu_ps(wk), w1 = _mm512_loadu_ps(wk + 16), w2 = _mm512_loadu_ps(wk + 32),
           w3 = _mm512_loadu_ps(wk + 48);
    for (int m = 0; m < M; ++m) {
      __m512 b = _mm512_set1_ps(x[m * K + k]);
      a[m][0] = _mm512_fmadd_ps(b, w0, a[m][0]);
      a[m][1] = _mm512_fmadd_ps(b, w1, a[m][1]);
      a[m][2] = _mm512_fmadd_ps(b, w2, a[m][2]);
      a[m][3] = _mm512_fmadd_ps(b, w3, a[m][3]);
    }
  }
  for (int m = 0; m < M; ++m) for (int j = 0; j < 4; ++j) _mm512_storeu_ps(y + m * N + n0 + 16 * j, a[m][j]);
}

static void block(int64_t M, const float* x, int64_t K, const float* wp, float* y, int64_t N, int64_t n0) {
  for (int64_t m = 0; m < M;) {
    const float* xm = x + m * K; float* ym = y + m * N;
    switch (M - m >= 6 ? 6 : M - m) {
      case 6: tile<6>(xm, K, wp, ym, N, n0); m += 6; break;
      case 5: tile<5>(xm, K, wp, ym, N, n0); m += 5; break;
      case 4: tile<4>(xm, K, wp, ym, N, n0); m += 4; break;
      case 3: tile<3>(xm, K, wp, ym, N, n0); m += 3; break;
      case 2: tile<2>(xm, K, wp, ym, N, n0); m += 2; break;
      default: tile<1>(xm, K, wp, ym, N, n0); m += 1; break;
    }
  }
}

torch::Tensor linear(torch::Tensor x, torch::Tensor wp) {
  auto M = x.size(0), K = x.size(1), N = wp.size(0) * 64;
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>(); const float* w = wp.data_ptr<float>(); float* yp = y.data_ptr<float>();
  at::parallel_for(0, N / 64, 1, [&](int64_t b, int64_t e) {
    for (int64_t p = b; p < e; ++p) block(M, xp, K, w + p * K * 64, yp, N, p * 64);
  });
  return y;
}
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,5,9,17", help="rows per matmul (tokens in the pass)")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    info = cpu_info()
    if "avx512f" not in info["flags"]:
        raise SystemExit(f"this experiment's kernel needs AVX-512F; this CPU has {' '.join(info['flags'])}")
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    ext = load_inline("verispec_skinny_linear", cpp_sources=SOURCE, functions=["pack", "linear"],
                      extra_cflags=["-O3", "-mavx512f", "-mfma"])
    print(f"cpu: {info['model']} ({' '.join(info['flags'])}); {args.threads} threads; kernel built in {time.perf_counter() - t0:.1f} s")
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=g) * 0.02 for _ in range(30) for n, k in SHAPES]
    weights.append(torch.randn(49152, 576, generator=g) * 0.02)  # the lm_head
    mine = [ext.pack(w) for w in weights]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH_HINT) for w in weights]
    x = torch.randn(9, 576, generator=g)
    full = ext.linear(x, mine[0])
    print(f"max difference from F.linear {(full - torch.nn.functional.linear(x, weights[0])).abs().max().item():.2e}; "
          "a row alone bitwise equal to the same row of 9:", torch.equal(ext.linear(x[4:5], mine[0]), full[4:5]))
    rows = [int(r) for r in args.rows.split(",")]
    times: dict = {}
    for _ in range(args.repeats):
        for m in rows:
            xs = [torch.randn(m, w.shape[1]) for w in weights]
            for name in ("hand-written", "oneDNN-packed"):
                t0 = time.perf_counter()
                if name == "hand-written":
                    for xi, p in zip(xs, mine):
                        ext.linear(xi, p)
                else:
                    for xi, p in zip(xs, onednn):
                        torch.ops.mkldnn._linear_pointwise(xi, p, None, "none", [], "")
                times.setdefault((name, m), []).append(time.perf_counter() - t0)
    for m in rows:
        print(f"{m:3d} rows: " + ", ".join(f"{n} {statistics.median(times[n, m]) * 1e3:.1f} ms"
                                          for n in ("hand-written", "oneDNN-packed")))

    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(256, 576, dtype=dtype), torch.randn(576, 1536, dtype=dtype)
        best = min(mean_seconds(lambda: a @ b, 50) for _ in range(5))
        print(f"in-cache matmul, {dtype}: {2 * 256 * 576 * 1536 / best / 1e9:.0f} GFLOP/s")


def mean_seconds(fn, n: int) -> float:
    """Mean seconds of ``fn`` over ``n`` calls after one warm-up call."""
    fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


if __name__ == "__main__":
    main()
