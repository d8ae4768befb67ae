import torch, time, statistics, numpy as np, numba
from numba import njit, prange
numba.set_num_threads(2)
@njit(parallel=True, fastmath=True, cache=True, boundscheck=False)
def gemm_m4(x, w, out):
    # x [M4, K] with M4 a multiple of 4; out [M4, N]
    M, K = x.shape
    N = w.shape[0]
    for n in prange(N):
        for mb in range(0, M, 4):
            a0 = np.float32(0.0); a1 = np.float32(0.0); a2 = np.float32(0.0); a3 = np.float32(0.0)
            for k in range(K):
                wv = w[n, k]
                a0 += x[mb, k] * wv; a1 += x[mb+1, k] * wv; a2 += x[mb+2, k] * wv; a3 += x[mb+3, k] * wv
            out[mb, n] = a0; out[mb+1, n] = a1; out[mb+2, n] = a2; out[mb+3, n] = a3
@njit(parallel=True, fastmath=True, cache=True, boundscheck=False)
def gemm_m8(x, w, out):
    M, K = x.shape
    N = w.shape[0]
    for n in prange(N):
        for mb in range(0, M, 8):
            a0 = np.float32(0.0); a1 = np.float32(0.0); a2 = np.float32(0.0); a3 = np.float32(0.0)
            a4 = np.float32(0.0); a5 = np.float32(0.0); a6 = np.float32(0.0); a7 = np.float32(0.0)
            for k in range(K):
                wv = w[n, k]
                a0 += x[mb, k] * wv; a1 += x[mb+1, k] * wv; a2 += x[mb+2, k] * wv; a3 += x[mb+3, k] * wv
                a4 += x[mb+4, k] * wv; a5 += x[mb+5, k] * wv; a6 += x[mb+6, k] * wv; a7 += x[mb+7, k] * wv
            out[mb, n] = a0; out[mb+1, n] = a1; out[mb+2, n] = a2; out[mb+3, n] = a3
            out[mb+4, n] = a4; out[mb+5, n] = a5; out[mb+6, n] = a6; out[mb+7, n] = a7
def med(fn, r=9):
    fn(); ts=[]
    for _ in range(r):
        t=time.perf_counter(); fn(); ts.append(time.perf_counter()-t)
    return statistics.median(ts)*1000
torch.manual_seed(0)
S=[(576,576),(192,576),(192,576),(576,576),(1536,576),(1536,576),(576,1536)]
ws=[torch.randn(o,i) for _ in range(30) for o,i in S]+[torch.randn(49152,576)]
wn=[w.numpy() for w in ws]
nb=sum(w.numel()*4 for w in ws)
for name,f,blk in (("m4",gemm_m4,4),("m8",gemm_m8,8)):
  for rows in (1,9,17):
    M=-(-rows//blk)*blk
    xs={n: np.random.randn(M,n).astype(np.float32) for n in (576,1536)}
    outs=[np.empty((M,w.shape[0]),np.float32) for w in wn]
    t=med(lambda: [f(xs[w.shape[1]], w, o) for w,o in zip(wn,outs)])
    x=xs[576]; w=wn[-1]; o=np.empty((M,w.shape[0]),np.float32); f(x,w,o)
    xb=np.zeros((blk,576),np.float32); xb[0]=x[M-1]; o1=np.empty((blk,w.shape[0]),np.float32); f(xb,w,o1)
    print(name, rows, f"{t:.1f} ms {nb/t/1e6:.1f} GB/s; last row equal alone:", np.array_equal(o[M-1],o1[0]), flush=True)
