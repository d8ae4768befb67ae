import torch, time, statistics
from verispec.cpu import PACK_BATCH_HINT
torch.manual_seed(0); import sys; torch.set_num_threads(int(sys.argv[1]))
def med(fn, r=9):
    fn(); ts=[]
    for _ in range(r):
        t=time.perf_counter(); fn(); ts.append(time.perf_counter()-t)
    return statistics.median(ts)*1000
S=[(576,576),(192,576),(192,576),(576,576),(1536,576),(1536,576),(576,1536)]
ws=[torch.randn(o,i) for _ in range(30) for o,i in S]
nb=sum(w.numel()*4 for w in ws)
with torch.inference_mode():
  for rows in (1,9,17):
    xs={n: torch.randn(rows,n) for n in (576,1536)}
    mk=[torch.ops.mkl._mkl_reorder_linear_weight(w, rows) for w in ws]
    t=med(lambda: [torch.ops.mkl._mkl_linear(xs[w.shape[1]], p, w, None, rows) for w,p in zip(ws,mk)])
    ps=[torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH_HINT) for w in ws]
    t2=med(lambda: [torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "") for w,p in zip(ws,ps)])
    print(rows, f"mkl packed {t:.1f} ms {nb/t/1e6:.1f} GB/s; onednn {t2:.1f} ms {nb/t2/1e6:.1f}")
