import torch, time, statistics, numpy as np, numba
from numba import njit, prange
torch.manual_seed(0)
numba.set_num_threads(2)
@njit(parallel=True, fastmath=True, cache=True, boundscheck=False)
def gemv(x, w, out):
    M, K = x.shape
    N = w.shape[0]
    for n in prange(N):
        for m in range(M):
            acc = np.float32(0.0)
            for k in range(K):
                acc += x[m, k] * w[n, k]
            out[m, n] = acc
@njit(parallel=True, fastmath=True, cache=True, boundscheck=False)
def gemv4(x, w, out):
    M, K = x.shape
    N = w.shape[0]
    nb = N // 4
    for b in prange(nb):
        n = b * 4
        for m in range(M):
            a0 = np.float32(0.0); a1 = np.float32(0.0); a2 = np.float32(0.0); a3 = np.float32(0.0)
            for k in range(K):
                xv = x[m, k]
                a0 += xv * w[n, k]; a1 += xv * w[n+1, k]; a2 += xv * w[n+2, k]; a3 += xv * w[n+3, k]
            out[m, n] = a0; out[m, n+1] = a1; out[m, n+2] = a2; out[m, n+3] = a3
def med(fn, r=9):
    fn(); ts=[]
    for _ in range(r):
        t=time.perf_counter(); fn(); ts.append(time.perf_counter()-t)
    return statistics.median(ts)*1000
S=[(576,576),(192,576),(192,576),(576,576),(1536,576),(1536,576),(576,1536)]
ws=[torch.randn(o,i) for _ in range(30) for o,i in S]+[torch.randn(49152,576)]
wn=[w.numpy() for w in ws]
nb=sum(w.numel()*4 for w in ws)
for rows in (1,9,17):
    xs={n: np.random.randn(rows,n).astype(np.float32) for n in (576,1536)}
    outs=[np.empty((rows,w.shape[0]),np.float32) for w in wn]
    for name,f in (("gemv",gemv),("gemv4",gemv4)):
        t=med(lambda: [f(xs[w.shape[1]], w, o) for w,o in zip(wn,outs)])
        print(rows, name, f"{t:.1f} ms {nb/t/1e6:.1f} GB/s", flush=True)
    # row independence & accuracy
    x=xs[576]; w=wn[-1]; o=np.empty((rows,w.shape[0]),np.float32); gemv(x,w,o); o1=np.empty((1,w.shape[0]),np.float32); gemv(x[:1].copy(),w,o1)
    ref=(torch.from_numpy(x).double()@torch.from_numpy(w).double().T).numpy()
    print("  row0 identical:", np.array_equal(o[0],o1[0]), "max err vs f64", float(np.abs(o-ref).max()))
