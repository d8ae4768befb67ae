"""The native kernel's arithmetic in plain PyTorch: the tests' reference, bit for bit.

``matmul(x, raw, kind)`` computes what ``verispec.blockmm.matmul`` computes, with the same roundings in the same order
(the steps are numbered as in ``_native.cpp``'s header):

1. each row of x quantized per 32 values: d = amax / 127, q = round_half_even(x * (1 / d)), dx = d, sx = d * sum(q);
2. the weights as integers w, per 32 weights the floats A and B (weight = A * c * w + B), Q6_K's integer sub-scale c
   per 16 weights;
3. per 32-weight chunk the exact integer dot s = sum(c * w * q); chunk j of a group of eight lands in float lane j:
   acc = acc + float(s) * (A * dx), then acc = acc + B * sx;
4. y = ((acc0 + acc1) + (acc2 + acc3)) + ((acc4 + acc5) + (acc6 + acc7)).

The K types (Q4_K, Q5_K, Q6_K) take one float step a 256-weight super-block instead: its whole integer dot
S = sum(c * w * q) (each weight times its integer sub-scale; exact in int32), acc = acc + float(S) * (d * dx), the
minimums' accm = accm + float(sum_j mins_j * bsum_j) * (dmin * dx), and y = acc - accm. A whole super-block's integer
is what every instruction set can compute exactly, AMX tile products included.

It is slow (an integer tensor of every product) and meant for small shapes.
"""

from __future__ import annotations

import torch

from .formats import block_type


def _half(raw: torch.Tensor) -> torch.Tensor:
    """float16 values stored as two little-endian bytes [..., 2] -> float32 [...]."""
    return raw.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes -> 32 weights: low nibbles are weights 0-15, high nibbles 16-31."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _bits(raw4: torch.Tensor) -> torch.Tensor:
    """4 bytes (a little-endian uint32) -> its 32 bits as 0/1 [..., 32]."""
    b = raw4.to(torch.int64)
    word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
    return (word[..., None] >> torch.arange(32)) & 1


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: eight 6-bit scales and minimums from 12 bytes (llama.cpp's get_scale_min_k4)."""
    s = s.to(torch.int64)
    sc = torch.cat([s[..., 0:4] & 63, (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)], dim=-1)
    mn = torch.cat([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], dim=-1)
    return sc, mn


def unpack(raw: torch.Tensor, kind: str, columns: int):
    """A matrix's blocks [rows, bytes a row] -> (w [rows, columns] int64, A [rows, columns/32], B [rows, columns/32],
    c [rows, columns/16] int64)."""
    t = block_type(kind)
    rows = raw.shape[0]
    b = raw.reshape(rows, columns // t.weights, t.bytes).to(torch.uint8)
    chunks = columns // 32
    c = torch.ones(rows, columns // 16, dtype=torch.int64)
    if kind in ("Q4_0", "Q4_1", "Q5_0", "Q8_0"):
        d = _half(b[..., 0:2])
        if kind == "Q8_0":
            w = b[..., 2:34].contiguous().view(torch.int8).to(torch.int64)
            B = torch.zeros_like(d)
        elif kind == "Q4_1":
            w, B = _nibbles(b[..., 4:20]).to(torch.int64), _half(b[..., 2:4])
        elif kind == "Q4_0":
            w, B = _nibbles(b[..., 2:18]).to(torch.int64), -8.0 * d
        else:
            w = _nibbles(b[..., 6:22]).to(torch.int64) | (_bits(b[..., 2:6]) << 4)
            B = -16.0 * d
        return w.reshape(rows, columns), d, B, c
    if kind in ("Q4_K", "Q5_K"):
        d, dmin = _half(b[..., 0:2]), _half(b[..., 2:4])
        sc, mn = _k_scales(b[..., 4:16])
        qs = b[..., 16:144] if kind == "Q4_K" else b[..., 48:176]
        qs = qs.to(torch.int64).reshape(rows, -1, 4, 32)
        w = torch.stack([qs & 0x0F, qs >> 4], dim=-2)  # [rows, blocks, 4, 2, 32]
        if kind == "Q5_K":
            qh = b[..., 16:48].to(torch.int64).reshape(rows, -1, 1, 1, 32)
            shift = torch.arange(8).reshape(4, 2, 1)
            w = w | (((qh >> shift) & 1) << 4)
        A = d[..., None] * sc.float()
        B = -(dmin[..., None] * mn.float())
        return w.reshape(rows, columns), A.reshape(rows, chunks), B.reshape(rows, chunks), c
    if kind == "Q6_K":
        ql = b[..., 0:128].to(torch.int64).reshape(rows, -1, 2, 64)
        qh = b[..., 128:192].to(torch.int64).reshape(rows, -1, 2, 32)
        sc = b[..., 192:208].contiguous().view(torch.int8).to(torch.int64)
        d = _half(b[..., 208:210])
        parts = [(ql[..., 0:32] & 0x0F) | ((qh & 3) << 4), (ql[..., 32:64] & 0x0F) | (((qh >> 2) & 3) << 4),
                 (ql[..., 0:32] >> 4) | (((qh >> 4) & 3) << 4), (ql[..., 32:64] >> 4) | (((qh >> 6) & 3) << 4)]
        w = torch.stack(parts, dim=-2) - 32  # [rows, blocks, 2 halves, 4 parts, 32]
        A = d[..., None].expand(rows, d.shape[1], 8)
        return w.reshape(rows, columns), A.reshape(rows, chunks), torch.zeros(rows, chunks), \
            sc.reshape(rows, columns // 16)
    raise ValueError(kind)


K_TYPES = ("Q4_K", "Q5_K", "Q6_K")


def _quantize(v: torch.Tensor):
    """v [..., n] -> (q [..., n] float holding integers, d [...]): d = amax / 127, q = round_half_even(v * (1 / d))."""
    amax = v.abs().amax(dim=-1)
    d = amax / 127.0
    inv = torch.where(d != 0, 1.0 / torch.where(d != 0, d, torch.ones_like(d)), torch.zeros_like(d))
    return torch.round(v * inv[..., None]).clamp(-127, 127), d


def quantize_rows(x: torch.Tensor, per: int = 32):
    """x [M, K] float32 -> (q [M, K] int64, d [M, K/per], sums [M, K/32] int64): activations quantized per ``per``
    values (32 for the 32-weight types, 256 for the K types), and the sum of q over each 32."""
    M, K = x.shape
    q, d = _quantize(x.float().reshape(M, K // per, per))
    q = q.to(torch.int64).reshape(M, K)
    return q, d, q.reshape(M, K // 32, 32).sum(dim=-1)


def dequantize(raw: torch.Tensor, kind: str, columns: int) -> torch.Tensor:
    """The weights the blocks hold, [rows, columns] float32 (what llama.cpp's dequantization gives)."""
    w, A, B, c = unpack(raw, kind, columns)
    rows = w.shape[0]
    cw = (w * c.repeat_interleave(16, dim=1)).float().reshape(rows, -1, 32)
    return (A[..., None] * cw + B[..., None]).reshape(rows, columns)


def _lanes_sum(acc: torch.Tensor) -> torch.Tensor:
    return ((acc[..., 0] + acc[..., 1]) + (acc[..., 2] + acc[..., 3])) + \
        ((acc[..., 4] + acc[..., 5]) + (acc[..., 6] + acc[..., 7]))


def matmul(x: torch.Tensor, raw: torch.Tensor, kind: str) -> torch.Tensor:
    """y [M, N] = x [M, K] times the blocks' matrix [N, K] transposed, with the kernel's roundings."""
    return (_matmul_k if kind in K_TYPES else _matmul_32)(x, raw, kind)


def _matmul_32(x: torch.Tensor, raw: torch.Tensor, kind: str) -> torch.Tensor:
    M, K = x.shape
    w, A, B, _ = unpack(raw, kind, K)
    q, dx, sums = quantize_rows(x, 32)
    sx = dx * sums.float()  # a sum of at most 32 integers of <= 127: exact in float32
    N, C = w.shape[0], K // 32
    s = torch.einsum("mci,nci->mnc", q.reshape(M, C, 32), w.reshape(N, C, 32))  # exact integer dots [M, N, C]
    G = (C + 7) // 8
    pad = G * 8 - C

    def lanes(t: torch.Tensor) -> torch.Tensor:  # [..., C] -> [..., G, 8], zeros past the last chunk
        return torch.nn.functional.pad(t, (0, pad)).reshape(*t.shape[:-1], G, 8)

    s, A, B, dx, sx = lanes(s.float()), lanes(A), lanes(B), lanes(dx), lanes(sx)
    acc = torch.zeros(M, N, 8)
    for g in range(G):
        t = A[None, :, g] * dx[:, None, g]
        acc = acc + s[:, :, g] * t
        acc = acc + B[None, :, g] * sx[:, None, g]
    return _lanes_sum(acc)


def _matmul_k(x: torch.Tensor, raw: torch.Tensor, kind: str) -> torch.Tensor:
    M, K = x.shape
    G = K // 256
    w, _, _, c = unpack(raw, kind, K)
    N = w.shape[0]
    rb = raw.reshape(N, G, -1)
    if kind == "Q6_K":
        d, dmin = _half(rb[..., 208:210]), torch.zeros(N, G)
        mins = torch.zeros(N, G, 8, dtype=torch.int64)
    else:
        d, dmin = _half(rb[..., 0:2]), _half(rb[..., 2:4])
        sc, mins = _k_scales(rb[..., 4:16])
        c = sc.repeat_interleave(2, dim=-1).reshape(N, K // 16)  # the integer sub-scale of each 16 weights
    q, dx, bsum = quantize_rows(x, 256)
    cw = w * c.repeat_interleave(16, dim=1)  # each weight times its integer sub-scale
    # a super-block's whole integer dot (exact)
    prod = torch.einsum("mgk,ngk->mng", q.reshape(M, G, 256), cw.reshape(N, G, 256))
    im = torch.einsum("mgj,ngj->mng", bsum.reshape(M, G, 8), mins)
    acc = torch.zeros(M, N)
    accm = torch.zeros(M, N)
    for g in range(G):
        t = d[None, :, g] * dx[:, None, g]
        acc = acc + prod[:, :, g].float() * t
        u = dmin[None, :, g] * dx[:, None, g]
        accm = accm + im[:, :, g].float() * u
    return acc - accm
