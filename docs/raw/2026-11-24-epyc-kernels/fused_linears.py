import torch, time, statistics
from verispec.cpu import PACK_BATCH_HINT
torch.manual_seed(0)
def med(fn, r=9):
    fn(); ts=[]
    for _ in range(r):
        t=time.perf_counter(); fn(); ts.append(time.perf_counter()-t)
    return statistics.median(ts)*1000
S=[(576,576),(192,576),(192,576),(576,576),(1536,576),(1536,576),(576,1536)]
F=[(960,576),(576,576),(3072,576),(576,1536)]
for name,shapes in (("sep",S),("fused",F)):
    ws=[torch.randn(o,i) for _ in range(30) for o,i in shapes]
    ps=[torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH_HINT) for w in ws]
    nb=sum(w.numel()*4 for w in ws)
    for rows in (1,9):
        xs={n: torch.randn(1,rows,n) for n in (576,1536)}
        def run():
            for w,p in zip(ws,ps): torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")
        with torch.inference_mode():
            t=med(run)
        print(name, rows, f"{t:.1f} ms {nb/t/1e6:.1f} GB/s calls={len(ws)}")
    # lm_head alone
lm=torch.randn(49152,576); lp=torch.ops.mkldnn._reorder_linear_weight(lm, PACK_BATCH_HINT)
for rows in (1,9):
    x=torch.randn(1,rows,576)
    with torch.inference_mode():
        t=med(lambda: torch.ops.mkldnn._linear_pointwise(x, lp, None, "none", [], ""))
        t2=med(lambda: torch.nn.functional.linear(x, lm))
    print("lm_head", rows, f"packed {t:.2f} ms {lm.numel()*4/t/1e6:.1f} GB/s, mkl {t2:.2f}")
