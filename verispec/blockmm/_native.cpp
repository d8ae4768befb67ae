// y = x W^T on a GGUF file's own quantized blocks, for x of M rows (1..64 in decoding), row-invariant by construction.
//
// The arithmetic (verispec/blockmm/reference.py computes the same numbers with torch, bit for bit):
//
//   1. Each row of x is quantized per 32 values, as llama.cpp quantizes activations (block_q8_0): amax = max |x|,
//      d = amax / 127, q = round_half_even(x * (1 / d)) in [-127, 127]; dx = d, sx = d * sum(q).
//   2. Each weight block is unpacked once per call into integers w (one byte a weight) and, per 32 weights, two
//      floats A and B with weight = A * c * w + B, where c is an integer sub-scale (Q6_K's per 16 weights, else 1).
//   3. For each 32-weight chunk j the integer dot s_j = sum(c * w * q) is exact (int32); chunks are taken eight at a
//      time (a "group": a K-quant super-block, or eight 32-weight blocks) and the group's eight chunks land in eight
//      float lanes:  acc[l] = acc[l] + float(s_j) * (A_j * dx_j);  acc[l] = acc[l] + B_j * sx_j.
//   4. y = ((acc0 + acc1) + (acc2 + acc3)) + ((acc4 + acc5) + (acc6 + acc7)).
//
// The K types (Q4_K, Q5_K, Q6_K) take one float step a super-block: activations quantized per 256 values (llama.cpp's
// block_q8_K: dx per 256, bsum = sum(q) per 32), the super-block's whole integer dot S = sum(c * w * q) with every
// weight times its integer sub-scale (exact in int32, so any instruction set computes it: vpmaddwd lanes summed, or AMX
// tile products per chunk times their sub-scales), then acc = acc + float(S) * (d * dx) and
// accm = accm + float(sum_j mins_j * bsum_j) * (dmin * dx); y = acc - accm.
//
// Every float operation is one IEEE rounding in a fixed order (built with -ffp-contract=off: no fused multiply-add),
// so row i of y depends on row i of x and on W alone: not on M, not on the other rows, not on the thread count,
// and not on which instruction set ran it (the scalar, AVX2 and VNNI paths give the same bits).
//
// Instruction sets are chosen at run time (__builtin_cpu_supports): AVX-512 VNNI / AVX-VNNI, else AVX2 + FMA, else
// portable scalar code. Threads split the output columns (W's rows); each thread unpacks its own rows.

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#if defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#define VS_X86 1
// GCC 12's AVX-512 headers build casts from a self-initialized "undefined" vector, which -Wmaybe-uninitialized
// (and -Wuninitialized, for the conversions' pass-through operand) reports once per inlined use (GCC bug 105593);
// the values are defined: the lanes read are the source's
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include <immintrin.h>
#else
#define VS_X86 0
#endif

namespace {

// ---------------------------------------------------------------------------------------------------------------
// Block formats (ggml's layouts; ids are ggml's type numbers)

enum Kind : int { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

struct Format {
    int block;  // weights per block
    int bytes;  // bytes per block
};

bool format_of(int kind, Format* f) {
    switch (kind) {
        case Q4_0: *f = {32, 18}; return true;
        case Q4_1: *f = {32, 20}; return true;
        case Q5_0: *f = {32, 22}; return true;
        case Q8_0: *f = {32, 34}; return true;
        case Q4_K: *f = {256, 144}; return true;
        case Q5_K: *f = {256, 176}; return true;
        case Q6_K: *f = {256, 210}; return true;
        default: return false;
    }
}

inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {  // subnormal: normalize
            int e = -1;
            do { e++; man <<= 1; } while (!(man & 0x400));
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3FF) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7F800000u | (man << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    float out;
    std::memcpy(&out, &bits, 4);
    return out;
}

inline float rd_half(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return half_to_float(h);
}

// One group unpacked: a K-quant super-block, or eight 32-weight blocks.
struct Group {
    alignas(64) int8_t w[256];
    alignas(32) int16_t sw[16];     // K types: the integer sub-scale of each 16 weights
    alignas(64) int16_t cv[8][16];  // the same laid out per chunk for vpmaddwd (SIMD paths)
    alignas(32) float A[8];         // 32-weight types: weight = A * w + B per block
    alignas(32) float B[8];
    alignas(16) int16_t mins[8];    // Q4_K / Q5_K: the 6-bit minimums
    float d, dmin;                  // K types: the super-block's factors
    int chunks;                     // 1..8 (a tail group of a 32-weight type may hold fewer)
};

inline bool is_k(int kind) { return kind == Q4_K || kind == Q5_K || kind == Q6_K; }

// Q4_K / Q5_K: the eight 6-bit scales (bytes 0-7 of out, or words 0-1 of u) and minimums (8-15, words 2-3) from 12
// bytes (llama.cpp's kmask trick)
inline void k_scale_words(const uint8_t* s, uint32_t* u) {
    std::memcpy(u, s, 12);
    u[3] = ((u[2] >> 4) & 0x0f0f0f0f) | (((u[1] >> 6) & 0x03030303) << 4);
    const uint32_t aux = u[1] & 0x3f3f3f3f;
    u[1] = (u[2] & 0x0f0f0f0f) | (((u[0] >> 6) & 0x03030303) << 4);
    u[2] = aux;
    u[0] &= 0x3f3f3f3f;
}

inline void k_scales(const uint8_t* s, uint8_t* out) {
    uint32_t u[4];
    k_scale_words(s, u);
    std::memcpy(out, u, 16);
}

// The factors of a group (at most 8 per 256 weights), shared by every instruction set.
void group_factors(int kind, const uint8_t* src, int chunks, Group* g) {
    g->chunks = chunks;
    switch (kind) {
        case Q4_0: case Q5_0: case Q8_0: case Q4_1: {
            const int bytes = kind == Q4_0 ? 18 : kind == Q4_1 ? 20 : kind == Q5_0 ? 22 : 34;
            for (int j = 0; j < 8; j++) { g->A[j] = 0.0f; g->B[j] = 0.0f; }
            for (int j = 0; j < chunks; j++) {
                const uint8_t* b = src + j * bytes;
                const float d = rd_half(b);
                g->A[j] = d;
                g->B[j] = kind == Q4_0 ? -8.0f * d : kind == Q5_0 ? -16.0f * d : kind == Q4_1 ? rd_half(b + 2) : 0.0f;
            }
            break;
        }
        case Q4_K: case Q5_K: {
            g->d = rd_half(src);
            g->dmin = rd_half(src + 2);
            uint8_t sm[16];
            k_scales(src + 4, sm);
            for (int j = 0; j < 8; j++) {
                g->sw[2 * j] = g->sw[2 * j + 1] = sm[j];
                g->mins[j] = sm[8 + j];
            }
            break;
        }
        case Q6_K: {
            g->d = rd_half(src + 208);
            g->dmin = 0.0f;
            const int8_t* sc = (const int8_t*)(src + 192);
            for (int j = 0; j < 16; j++) g->sw[j] = sc[j];
            for (int j = 0; j < 8; j++) g->mins[j] = 0;
            break;
        }
    }
}

// Portable unpacking of a group's integers (the reference for the SIMD versions).
void unpack_scalar(int kind, const uint8_t* src, int chunks, Group* g) {
    group_factors(kind, src, chunks, g);
    std::memset(g->w, 0, sizeof(g->w));
    switch (kind) {
        case Q4_0: case Q4_1: case Q5_0: {
            const int bytes = kind == Q4_0 ? 18 : kind == Q4_1 ? 20 : 22;
            const int qs_at = kind == Q4_0 ? 2 : kind == Q4_1 ? 4 : 6;
            for (int j = 0; j < chunks; j++) {
                const uint8_t* b = src + j * bytes;
                uint32_t qh = 0;
                if (kind == Q5_0) std::memcpy(&qh, b + 2, 4);
                for (int l = 0; l < 16; l++) {
                    int lo = b[qs_at + l] & 0xF, hi = b[qs_at + l] >> 4;
                    if (kind == Q5_0) {
                        lo |= ((qh >> l) & 1) << 4;
                        hi |= ((qh >> (l + 16)) & 1) << 4;
                    }
                    g->w[32 * j + l] = (int8_t)lo;
                    g->w[32 * j + 16 + l] = (int8_t)hi;
                }
            }
            break;
        }
        case Q8_0:
            for (int j = 0; j < chunks; j++) std::memcpy(g->w + 32 * j, src + j * 34 + 2, 32);
            break;
        case Q4_K: case Q5_K: {
            const uint8_t* qh = src + 16;
            const uint8_t* qs = src + (kind == Q4_K ? 16 : 48);
            for (int j = 0; j < 4; j++)
                for (int l = 0; l < 32; l++) {
                    int lo = qs[32 * j + l] & 0xF, hi = qs[32 * j + l] >> 4;
                    if (kind == Q5_K) {
                        lo |= ((qh[l] >> (2 * j)) & 1) << 4;
                        hi |= ((qh[l] >> (2 * j + 1)) & 1) << 4;
                    }
                    g->w[64 * j + l] = (int8_t)lo;
                    g->w[64 * j + 32 + l] = (int8_t)hi;
                }
            break;
        }
        case Q6_K: {
            const uint8_t* ql = src;
            const uint8_t* qh = src + 128;
            for (int h = 0; h < 2; h++)
                for (int l = 0; l < 32; l++) {
                    const uint8_t* a = ql + 64 * h;
                    const uint8_t hb = qh[32 * h + l];
                    int8_t* o = g->w + 128 * h;
                    o[l] = (int8_t)(((a[l] & 0xF) | ((hb & 3) << 4)) - 32);
                    o[l + 32] = (int8_t)(((a[l + 32] & 0xF) | (((hb >> 2) & 3) << 4)) - 32);
                    o[l + 64] = (int8_t)(((a[l] >> 4) | (((hb >> 4) & 3) << 4)) - 32);
                    o[l + 96] = (int8_t)(((a[l + 32] >> 4) | (((hb >> 6) & 3) << 4)) - 32);
                }
            break;
        }
    }
}

// Activations of one row. 32-weight types: quantized per 32 values (dx, sx = dx * sum(q) per 32). K types: per 256
// values, as llama.cpp's block_q8_K (dx per 256, bsum = sum(q) per 32 as int16).
void quantize_span(const float* v, int n, int8_t* q, float* d_out, int* sum_out) {
    float amax = 0.0f;
    for (int i = 0; i < n; i++) amax = std::max(amax, std::fabs(v[i]));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    int sum = 0;
    for (int i = 0; i < n; i++) {
        float r = std::nearbyint(v[i] * id);  // round half to even (the default rounding mode)
        r = std::min(127.0f, std::max(-127.0f, r));
        q[i] = (int8_t)r;
        sum += (int)r;
    }
    *d_out = d;
    *sum_out = sum;
}

struct Problem {
    int kind;
    Format f;
    int M, N, K;
    int64_t row_bytes;
    const uint8_t* W;
    int G;                // groups a row
    int64_t q_stride;     // bytes of quantized activations a row (whole groups, zero-padded)
    const int8_t* qx;     // [M, q_stride]
    const float* dx;      // 32-weight types: [M, 8G]; K types: [M, G]
    const float* sx;      // 32-weight types: [M, 8G]
    const int16_t* bsum;  // sum(q) per 32 activations, [M, 8G]
    float* y;
    // the AMX path's activations (amx_layout), in blocks of 16 rows
    int mblocks = 0;
    const int8_t* qT = nullptr;
    const int16_t* bsT = nullptr;
    const float* dxT = nullptr;
    bool packed = false;  // W's rows laid out 16 at a time by pack16 (read by the 16-row tiles; Q4_K's by AMX tiles too)
    // matmul's call number (0: none): what a thread lays out from the activations for its first run of rows of a
    // call (interleaved16, sums16) it keeps for its next runs of the same call (row_chunks)
    uint64_t call = 0;
};

using SpanFn = void (*)(const float*, int, int8_t*, float*, int*);

void quantize_rows(Problem* p, const float* x, int8_t* qx, float* dx, float* sx, int16_t* bsum, SpanFn span,
                   int m0 = 0, int m1 = -1) {
    const int C = p->K / 32;
    if (m1 < 0) m1 = p->M;
    for (int m = m0; m < m1; m++) {
        const float* v = x + (int64_t)m * p->K;
        int8_t* q = qx + m * p->q_stride;
        if (is_k(p->kind)) {
            for (int g = 0; g < p->G; g++) {
                int total;
                span(v + 256 * g, 256, q + 256 * g, dx + (int64_t)m * p->G + g, &total);
                for (int j = 0; j < 8; j++) {
                    int sum = 0;
                    for (int i = 0; i < 32; i++) sum += q[256 * g + 32 * j + i];
                    bsum[((int64_t)m * p->G + g) * 8 + j] = (int16_t)sum;
                }
            }
        } else {
            for (int c = 0; c < C; c++) {
                int sum;
                float d;
                span(v + 32 * c, 32, q + 32 * c, &d, &sum);
                dx[(int64_t)m * 8 * p->G + c] = d;
                sx[(int64_t)m * 8 * p->G + c] = d * (float)sum;
                bsum[(int64_t)m * 8 * p->G + c] = (int16_t)sum;  // (Q8_0's 16-row tiles take it off their integers)
            }
        }
    }
}

inline float lanes_sum(const float* a) {
    return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

// ---------------------------------------------------------------------------------------------------------------
// Portable paths: the arithmetic every SIMD path reproduces bit for bit.
//
// 32-weight types: chunk j of a group lands in float lane j:
//   acc[j] = acc[j] + float(sum(w * q)) * (A_j * dx_j);  acc[j] = acc[j] + B_j * sx_j;   y = lanes(acc)
// K types: a super-block's whole integer dot S, each weight times its sub-scale (exact in int32):
//   acc = acc + float(S) * (d * dx);  accm = accm + float(sum_j mins_j * bsum_j) * (dmin * dx);  y = acc - accm

void row_dot_scalar32(const Problem& p, const Group* row, int m, float* out) {
    const int8_t* q = p.qx + m * p.q_stride;
    const float* dx = p.dx + (int64_t)m * 8 * p.G;
    const float* sx = p.sx + (int64_t)m * 8 * p.G;
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int gi = 0; gi < p.G; gi++) {
        const Group& g = row[gi];
        for (int j = 0; j < 8; j++) {
            int32_t s = 0;
            for (int i = 0; i < 32; i++) s += (int32_t)g.w[32 * j + i] * (int32_t)q[256 * gi + 32 * j + i];
            const float t = g.A[j] * dx[8 * gi + j];
            const float u = (float)s * t;
            acc[j] = acc[j] + u;
            const float v = g.B[j] * sx[8 * gi + j];
            acc[j] = acc[j] + v;
        }
    }
    *out = lanes_sum(acc);
}

void row_dot_scalar_k(const Problem& p, const Group* row, int m, float* out) {
    const int8_t* q = p.qx + m * p.q_stride;
    const float* dx = p.dx + (int64_t)m * p.G;
    const int16_t* bs = p.bsum + (int64_t)m * 8 * p.G;
    float acc = 0.0f;
    float accm = 0.0f;
    for (int gi = 0; gi < p.G; gi++) {
        const Group& g = row[gi];
        int32_t S = 0;
        for (int j = 0; j < 8; j++)
            for (int i = 0; i < 32; i++)
                S += (int32_t)g.sw[2 * j + i / 16] * (int32_t)g.w[32 * j + i] * (int32_t)q[256 * gi + 32 * j + i];
        const float t = g.d * dx[gi];
        acc = acc + (float)S * t;
        int32_t im = 0;
        for (int j = 0; j < 8; j++) im += (int32_t)g.mins[j] * (int32_t)bs[8 * gi + j];
        const float u = g.dmin * dx[gi];
        accm = accm + (float)im * u;
    }
    *out = acc - accm;
}

constexpr int NR = 4;  // weight rows unpacked together: each activation chunk loaded once serves NR rows

// The fused few-row path can be switched off (VERISPEC_BLOCKMM_FUSED=0) to compare it with the buffered one.
bool g_fused_off = false;
// bytes ahead of each super-block (group) that the one-row paths request, and on AVX2 the K types' tiles, which share
// their loop (0: none past the next rows' tile); set_prefetch
int g_prefetch = 4096;
// bytes ahead that the 16-row layout's readers request each block into L2 (fetch_ahead in simd_body.inc; 0: none, the
// hardware's prefetcher alone); set_packed_prefetch. Which distance is best depends on the CPU (docs/kernels.md)
int g_packed_ahead = 8192;
inline bool fused_off() { return g_fused_off; }
// Passes of at most g_one_row[kind] rows take the one-weight-row fused path: for a K type (up to 2 rows) against the
// tiles (AVX2) or tiles / the buffered path (AVX-512); for a 32-weight type (up to ROWS32 rows) against the buffered
// path. Which is faster depends on the CPU (measured: the K types' one-row path is faster on Zen 5 and for Q6_K on a Sapphire
// Rapids, 1.8x slower for Q4_K there), and every path gives the same bits, so the blocks backend times them on its
// own matrices (blockmm.choose_paths) and sets the limit per type; until then 2 for K types, 0 for the others.
int g_one_row[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 0};
constexpr int ROWS32 = 16;  // the most rows a 32-weight type's fused path takes (a group decoded once per 8 rows)
inline int one_row_most(int kind) { return is_k(kind) ? 2 : ROWS32; }
inline int one_row_max(int kind) { return g_one_row[kind & 15]; }
// AVX-512: whether Q6_K passes past the one-row limit take the tiles (1) or the buffered path (0; measured a little
// faster on a Zen 5); chosen per CPU the same way (blockmm.choose_paths).
int g_q6k_tiles = 0;
// super-blocks ahead that the AMX path requests each of its 16 rows' weights (amx_body.inc); VERISPEC_AMX_AHEAD
int g_amx_ahead = 1;
// AVX-512 VNNI: passes of a K type of at least g_wide16[kind] rows take the 16-row tiles (wide16 in simd_body.inc;
// 0: never), on the AVX-512 code whatever instruction set their width has otherwise; set_wide16, chosen per CPU and
// type by blockmm.choose_paths
constexpr int WIDE16_MIN = 2;  // one row: the one-row paths stream faster (docs/kernels.md)
int g_wide16[16] = {0};
inline bool wide16_on(int kind, int M) { return is_k(kind) && g_wide16[kind & 15] > 0 && M >= g_wide16[kind & 15]; }

// Q6_K in the 16-row layout (pack16): where the piece at byte o of a super-block sits (times 16 rows), in the order
// the tiles read it: the scales, then per half its high bits and its low nibbles, d last. In the file's order (low
// nibbles, high bits, scales, d) the tiles jumped back and forth through each 3,360 bytes: 4-row products streamed
// ~12% slower (docs/kernels.md, "2026-12-06 evening").
constexpr int q6_place(int o) {
    return o >= 208 ? o : o >= 192 ? o - 192 : o >= 160 ? o - 48 : o >= 128 ? o - 112 : o >= 64 ? o + 80 : o + 48;
}

// SLEEF's expf (u10) constants, for SiLU as torch computes it (silu_mul in simd_body.inc, silu_one)
constexpr float SILU_R_LN2 = 1.442695040888963407359924681001892137426645954152985934135449406931f;
constexpr float SILU_L2U = 0.693145751953125f, SILU_L2L = 1.428606765330187045e-06f;
constexpr float SILU_C[6] = {0.000198527617612853646278381f, 0.00139304355252534151077271f,
                             0.00833336077630519866943359f, 0.0416664853692054748535156f,
                             0.166666671633720397949219f, 0.5f};

typedef float vs_f8 __attribute__((vector_size(32)));  // eight float lanes (attend_body.inc)
typedef int32_t vs_i8 __attribute__((vector_size(32)));

#define VS_ATTEND_TARGET
namespace portable {
#include "attend_body.inc"
}  // namespace portable
#undef VS_ATTEND_TARGET

#if VS_X86
// The SIMD paths: one body (simd_body.inc) compiled for each instruction set, each function marked with its target so
// the rest of the library stays baseline x86-64 and runs on any CPU.
#define VS_TARGET __attribute__((target("avx2,fma,f16c")))
#define VS_USE_VNNI 0
#define VS_YMM_VNNI 0
namespace avx2 {
#define VS_ATTEND_TARGET VS_TARGET
#include "attend_body.inc"
#undef VS_ATTEND_TARGET
#include "simd_body.inc"
}
#undef VS_TARGET
#undef VS_YMM_VNNI
// The AVX2 body (256-bit registers, its tiles and shuffles) with VNNI's accumulating dot products (vpdpwssd,
// vpdpbusd on ymm, AVX-512 VL): one instruction where AVX2 takes two. For CPUs that run 512-bit instructions as two
// 256-bit halves (AMD Zen 4), where the AVX-512 tiles lose to the AVX2 ones (docs/kernels.md).
#define VS_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))
#define VS_YMM_VNNI 1
namespace vnni256 {
#define VS_ATTEND_TARGET VS_TARGET
#include "attend_body.inc"
#undef VS_ATTEND_TARGET
#include "simd_body.inc"
}
#undef VS_TARGET
#undef VS_USE_VNNI
#undef VS_YMM_VNNI
#define VS_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))
#define VS_USE_VNNI 1
#define VS_YMM_VNNI 1
namespace vnni {
#define VS_ATTEND_TARGET VS_TARGET
#include "attend_body.inc"
#undef VS_ATTEND_TARGET
#include "simd_body.inc"
#include "amx_body.inc"
}
#undef VS_TARGET
#undef VS_USE_VNNI
#undef VS_YMM_VNNI
#endif  // VS_X86

// ---------------------------------------------------------------------------------------------------------------
// Instruction set choice

// In order: a CPU that runs one runs those before it.
enum Isa : int { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_VNNI256 = 2, ISA_VNNI = 3 };
const char* ISA_NAMES[] = {"scalar", "avx2", "vnni256", "avx512vnni"};

int detect_isa() {
#if VS_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
        if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
            __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
            return ISA_VNNI;
        return ISA_AVX2;
    }
#endif
    return ISA_SCALAR;
}

// AMX-INT8 tile units, usable here: the CPU has them (CPUID), the OS keeps their state (XCR0) and lets this process
// use it (Linux's arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA, asked once). Only with AVX-512 VNNI (every AMX CPU has
// it), whose paths take the rows the tiles leave.
bool detect_amx() {
#if defined(__x86_64__) && defined(__linux__)
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!((d >> 24) & 1) || !((d >> 25) & 1)) return false;  // AMX-TILE, AMX-INT8
    if (!__get_cpuid(1, &a, &b, &c, &d) || !((c >> 27) & 1)) return false;  // OSXSAVE
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if (((lo >> 17) & 3) != 3) return false;  // XTILECFG, XTILEDATA
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
#else
    return false;
#endif
}

int g_best = -1;
int g_isa = -1;
int g_amx = -1;       // -1: not probed; 0: not usable here; 1: usable
int g_amx_rows[16] = {0};  // per block type: products of at least this many rows take the AMX tiles (0: none)
// The instruction set of products over 3 or more activation rows (-1: g_isa's). On a Zen 4 (AVX-512 double-pumped on
// 256-bit units) the AVX2 tiles beat the AVX-512 ones there; the paths compute the same bits, so the faster is kept.
int g_wide_isa = -1;
const int WIDE_ROWS = 3;
// The instruction set of products over 1 or 2 rows (-1: g_isa's). On a Zen 4 the 256-bit one-row paths beat the
// AVX-512 ones too (docs/kernels.md); attention and the other row kernels stay on g_isa.
int g_narrow_isa = -1;

void range_scalar(const Problem& p, int n0, int n1) {
    const int C = p.K / 32;
    const int per_group_src = p.f.block == 32 ? 8 : 1;
    std::vector<Group> row((size_t)p.G);
    for (int n = n0; n < n1; n++) {
        const uint8_t* src = p.W + (int64_t)n * p.row_bytes;
        for (int gi = 0; gi < p.G; gi++)
            unpack_scalar(p.kind, src + (int64_t)gi * per_group_src * p.f.bytes, std::min(8, C - 8 * gi), &row[gi]);
        for (int m = 0; m < p.M; m++) {
            if (is_k(p.kind)) row_dot_scalar_k(p, row.data(), m, p.y + (int64_t)m * p.N + n);
            else row_dot_scalar32(p, row.data(), m, p.y + (int64_t)m * p.N + n);
        }
    }
}

void run_range(const Problem& p, int n0, int n1, int isa) {
#if VS_X86
    if (isa == ISA_VNNI) return vnni::range(p, n0, n1);
    if (isa == ISA_VNNI256) return vnni256::range(p, n0, n1);
    if (isa == ISA_AVX2) return avx2::range(p, n0, n1);
#endif
    range_scalar(p, n0, n1);
}

// ---------------------------------------------------------------------------------------------------------------
// A small pool of threads that spin briefly between calls (a decoding pass makes ~200 calls in a row), then sleep.

struct Ahead {  // a matrix's blocks: where they start, rows, bytes a row
    const uint8_t* w = nullptr;
    int64_t N = 0, row_bytes = 0;
};
constexpr int PREP_SHARED_ROWS = 16;  // passes of this many rows or more quantize their activations on the pool
// Calls past the one-row paths (compute-bound) hand out their runs of rows a few at a time, each thread taking the
// next run when it is done, about g_row_chunks runs a thread (0: each thread one fixed share, as one-row calls keep
// for the look-ahead's shares): a fixed half left the calling thread waiting ~9% of an 8-token pass on the other
// (docs/kernels.md). Which thread computes a row changes no bit of it.
std::atomic<int> g_row_chunks{6};
std::atomic<uint64_t> g_calls{0};
// bytes fetched ahead between calls (set_lookahead; 0: off); workers read them while a caller may set them
std::atomic<int64_t> g_lookahead_own{0}, g_lookahead_other{0};

// The default: half of a core's L2 (where _MM_HINT_T1 puts the lines), 256 KB to 1 MB; 256 KB where it is not told.
int64_t default_lookahead() {
    long l2 = 0;
#ifdef _SC_LEVEL2_CACHE_SIZE
    l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
#endif
    return std::max<int64_t>(1 << 18, std::min<int64_t>(1 << 20, l2 > 0 ? l2 / 2 : 0));
}

class Pool {
  public:
    ~Pool() {
        {
            std::lock_guard<std::mutex> lock(mu_);
            stop_ = true;
            gen_.store((gen_.load() | WIDTH_BITS) + 1);  // the next generation, width 0
        }
        cv_.notify_all();
        for (auto& t : workers_) t.join();
    }

    // ``ahead``: the matrix the next call will most likely read (null: keep the last one named). Between calls each
    // worker asks for its own share of it (and worker 1 for the calling thread's share), so the framework's time
    // between two products is spent fetching the next one (set_lookahead).
    void run(int threads, const std::function<void(int, int)>& task, const Ahead* ahead = nullptr) {
        if (ahead) ahead_ = *ahead;
        threads = std::min(threads, (int)WIDTH_BITS);
        if (threads <= 1) { task(0, 1); return; }
        grow(threads - 1);
        task_ = &task;
        pending_.store(threads - 1, std::memory_order_relaxed);
        {
            std::lock_guard<std::mutex> lock(mu_);
            gen_.store(((gen_.load(std::memory_order_relaxed) | WIDTH_BITS) + 1) | (uint64_t)threads,
                       std::memory_order_release);
        }
        cv_.notify_all();
        task(0, threads);
        while (pending_.load(std::memory_order_acquire) != 0) relax();
        task_ = nullptr;
    }

  private:
    static inline void relax() {
#if VS_X86
        _mm_pause();
#else
        std::this_thread::yield();
#endif
    }

    void grow(int n) {
        while ((int)workers_.size() < n) {
            const int id = (int)workers_.size() + 1;
            const uint64_t seen = gen_.load(std::memory_order_acquire);  // read here: the next call's increment wakes it
            workers_.emplace_back([this, id, seen] { loop(id, seen); });
        }
    }

    void loop(int id, uint64_t seen) {
        Ahead fetched;  // what this worker has been fetching ahead, and how far
        int64_t own_done = 0, other_done = 0;
        for (;;) {
            uint64_t now = seen;
            for (int spin = 0; spin < 100000; spin++) {
                now = gen_.load(std::memory_order_acquire);
                if (now != seen) break;
                relax();
            }
            if (now == seen) {
                std::unique_lock<std::mutex> lock(mu_);
                cv_.wait(lock, [&] { return gen_.load(std::memory_order_acquire) != seen; });
                now = gen_.load(std::memory_order_acquire);
            }
            seen = now;
            if (stop_) return;
            // the call's width comes with its generation: a worker that sat out a call and woke late must not read
            // the next call's width (and run its task under this generation, then again under its own: pending_
            // counted down twice let a call return before its last rows were done, or called a cleared task)
            const int width = (int)(now & WIDTH_BITS);
            if (id < width) {
                const Ahead next = ahead_;  // read before the call ends: the caller may name another after it
                (*task_)(id, width);
                pending_.fetch_sub(1, std::memory_order_acq_rel);
                if (next.w != fetched.w || next.N != fetched.N) {
                    fetched = next;
                    own_done = other_done = 0;
                }
                look_ahead(fetched, id, width, seen, own_done, other_done);
            } else {
                look_ahead(fetched, id, width, seen, own_done, other_done);
            }
        }
    }

    // Ask for the first g_lookahead_own bytes of this worker's rows of ``a`` (split as matmul splits one-row calls),
    // and worker 1 for the first g_lookahead_other bytes of the calling thread's, 4 KB at a time from where the last
    // gap stopped, until the next call starts.
    void look_ahead(const Ahead& a, int id, int width, uint64_t seen, int64_t& own_done, int64_t& other_done) {
        if (!a.w || width < 2) return;
        const int64_t units = (a.N + NR - 1) / NR;
        auto share = [&](int who, int64_t limit, int64_t& done) {
            const int64_t n0 = std::min(a.N, units * who / width * NR);
            const int64_t n1 = std::min(a.N, units * (who + 1) / width * NR);
            const int64_t bytes = std::min(limit, (n1 - n0) * a.row_bytes);
            const uint8_t* base = a.w + n0 * a.row_bytes;
            while (done < bytes) {
                if (gen_.load(std::memory_order_relaxed) != seen) return false;
                const int64_t end = std::min(bytes, done + 4096);
                for (int64_t o = done; o < end; o += 64) prefetch_l2(base + o);
                done = end;
            }
            return true;
        };
        if (!share(id, g_lookahead_own.load(std::memory_order_relaxed), own_done)) return;
        if (id == 1) share(0, g_lookahead_other.load(std::memory_order_relaxed), other_done);
    }

    static inline void prefetch_l2(const uint8_t* p) {
#if VS_X86
        _mm_prefetch((const char*)p, _MM_HINT_T1);
#else
        __builtin_prefetch(p, 0, 2);
#endif
    }

    std::vector<std::thread> workers_;
    static constexpr uint64_t WIDTH_BITS = 0xFFFF;  // gen_: a call's number above these bits, its width in them
    std::atomic<uint64_t> gen_{0};
    std::atomic<int> pending_{0};
    const std::function<void(int, int)>* volatile task_ = nullptr;
    Ahead ahead_;
    std::mutex mu_;
    std::condition_variable cv_;
    bool stop_ = false;
};

Pool* g_pool = nullptr;
std::mutex g_call;  // one call at a time uses the pool (callers in several Python threads take turns)

void matmul(int kind, const float* x, const uint8_t* W, float* y, int M, int N, int K, int64_t row_bytes,
            int threads, int isa, const Ahead* ahead = nullptr, bool packed = false) {
    Format f;
    format_of(kind, &f);
    const int G = is_k(kind) ? K / 256 : (K / 32 + 7) / 8;
    const int64_t stride = 256 * (int64_t)G;  // each row's quantized activations padded to whole groups
#if VS_X86
    // the AMX tiles: the file's layout (amx_layout's copy of the activations), or Q4_K's and Q6_K's 16-row layout
    // (which reads the quantized rows themselves, in whole blocks of 16: the rows past M are zero)
    const bool amx = g_amx == 1 && is_k(kind) && g_amx_rows[kind & 15] > 0 && M >= g_amx_rows[kind & 15] &&
                     g_isa == ISA_VNNI && (!packed || kind == Q4_K || kind == Q6_K);
#else
    const bool amx = false;
#endif
    std::vector<int8_t> qx((size_t)(amx && packed ? (M + 15) / 16 * 16 : M) * stride, 0);
    std::vector<float> dx((size_t)M * 8 * G, 0.0f), sx((size_t)M * 8 * G, 0.0f);
    std::vector<int16_t> bsum((size_t)M * 8 * G, 0);
    Problem p{kind, f, M, N, K, row_bytes, W, G, stride, qx.data(), dx.data(), sx.data(), bsum.data(), y};
    p.packed = packed;
    p.call = g_calls.fetch_add(1, std::memory_order_relaxed) + 1;
    SpanFn span = quantize_span;
#if VS_X86
    if (isa == ISA_VNNI) span = vnni::quantize_span_simd;
    else if (isa == ISA_VNNI256) span = vnni256::quantize_span_simd;
    else if (isa == ISA_AVX2) span = avx2::quantize_span_simd;
#endif
    // Many rows: quantized (and laid out for the tiles) by the pool's threads, 16 rows a unit, each row the same
    // operations as alone; few: by the calling thread, where a pool round trip would cost more than the work.
    std::unique_lock<std::mutex> lock(g_call);
    if (!g_pool) g_pool = new Pool();
    const bool prep_shared = threads > 1 && M >= PREP_SHARED_ROWS;
    if (!prep_shared) quantize_rows(&p, x, qx.data(), dx.data(), sx.data(), bsum.data(), span);
    std::vector<int8_t> qT;
    std::vector<int16_t> bsT;
    std::vector<float> dxT;
    if (amx) p.mblocks = (M + 15) / 16;
    if (amx && !packed) {
        qT.assign((size_t)p.mblocks * 8 * G * 512, 0);
        bsT.assign((size_t)p.mblocks * G * 4 * 32, 0);
        dxT.assign((size_t)p.mblocks * G * 16, 0.0f);
#if VS_X86
        if (!prep_shared) vnni::amx_layout(p, qT.data(), bsT.data(), dxT.data());
#endif
        p.qT = qT.data();
        p.bsT = bsT.data();
        p.dxT = dxT.data();
    }
    // split W's rows into runs of NR (16 for the AMX tiles and the 16-row tiles), as evenly as possible
    const bool rows16 = amx || packed || (isa == ISA_VNNI && wide16_on(kind, M) && !fused_off());
    const int unit = rows16 ? 16 : NR;
    const int units = (N + unit - 1) / unit;
    threads = std::max(1, std::min(threads, units));
    const int chunks = g_row_chunks.load(std::memory_order_relaxed);
    const int chunk = !amx && chunks > 0 && M > one_row_max(kind) ? std::max(1, units / (threads * chunks)) : 0;
    std::atomic<int> handed{0};  // the runs handed out so far (chunk > 0)
    auto rows = [&](int u0, int u1) {
        const int n0 = std::min(N, u0 * unit), n1 = std::min(N, u1 * unit);
        if (n0 >= n1) return;
#if VS_X86
        if (amx) return !packed ? vnni::amx_range(p, n0, n1)
                       : kind == Q6_K ? vnni::amx_packed_range<Q6_K>(p, n0, n1) : vnni::amx_packed_range<Q4_K>(p, n0, n1);
#endif
        run_range(p, n0, n1, isa);
    };
    auto task = [&](int id, int width) {
        if (chunk)
            for (int u0; (u0 = handed.fetch_add(chunk, std::memory_order_relaxed)) < units;)
                rows(u0, std::min(units, u0 + chunk));
        else
            rows((int)((int64_t)units * id / width), (int)((int64_t)units * (id + 1) / width));
    };
    if (prep_shared) {
        const int blocks16 = (M + 15) / 16;
        auto prep = [&](int id, int width) {
            const int b0 = blocks16 * id / width, b1 = blocks16 * (id + 1) / width;
            if (b0 >= b1) return;
            quantize_rows(&p, x, qx.data(), dx.data(), sx.data(), bsum.data(), span, 16 * b0, std::min(M, 16 * b1));
#if VS_X86
            if (amx && !packed) vnni::amx_layout(p, qT.data(), bsT.data(), dxT.data(), b0, b1);
#endif
        };
        g_pool->run(std::min(threads, blocks16), prep);
    }
    g_pool->run(threads, task, ahead);
}

// The 16-row layout (pack16, read by the 16-row tiles at every width, and Q4_K's and Q6_K's by the AMX tiles:
// amx_packed_range):
// each run of 16 rows keeps its bytes (16 rows' worth, in place), laid out block by block (a K type's super-block, or one 32-weight block): block g of the 16 rows
// is one run of 16 x (bytes a block) where the block's piece at byte o of row r sits at byte 16 o + width r (Q6_K:
// 16 q6_place(o) + width r), so the
// tiles load four weights of all 16 rows, or one scale dword of each, as one vector (the unpacked layout needs
// 16-row transposes and gathers for that). The pieces are dwords, but for float16 halves: Q6_K's final d; the 32-weight
// types' leading d (and Q4_1's m), which so come as 16 halves side by side. Two 32-weight types change bits too, each
// a bijection undone by unpacking: Q8_0's weights are stored plus 128 (bit 7 flipped: the unsigned operand the tiles'
// vpdpbusd takes), and Q5_0's 32 high bits are reordered (q5_bits) so that one shift puts those of four weights at
// bit 4 of their bytes. N must be a multiple of 16.
inline int pack16_halves(int kind) { return kind == Q4_1 ? 2 : is_k(kind) ? 0 : 1; }

// Q5_0's high bits in the 16-row layout: bit 8b + k of the new dword is old bit 4k + b (weights 0-15: k, b < 4), bit
// 8b + 4 + k is old bit 16 + 4k + b (weights 16-31): the weights in byte b of the k-th dword of low (high) nibbles
inline uint32_t q5_bits(uint32_t h, bool back) {
    uint32_t out = 0;
    for (int k = 0; k < 4; k++)
        for (int b = 0; b < 4; b++)
            for (int part = 0; part < 2; part++) {
                const int old_bit = 16 * part + 4 * k + b, new_bit = 8 * b + 4 * part + k;
                if (back) out |= ((h >> new_bit) & 1u) << old_bit;
                else out |= ((h >> old_bit) & 1u) << new_bit;
            }
    return out;
}

// one block's bits changed (or back) in place in the 16-row layout: Q8_0's weights' bit 7, Q5_0's high bits
void pack16_bits(int kind, uint8_t* tiled, bool back) {
    if (kind == Q8_0)
        for (int i = 32; i < 16 * 34; i++) tiled[i] ^= 0x80;
    if (kind == Q5_0)
        for (int r = 0; r < 16; r++) {
            uint32_t h;
            std::memcpy(&h, tiled + 32 + 4 * r, 4);
            h = q5_bits(h, back);
            std::memcpy(tiled + 32 + 4 * r, &h, 4);
        }
}

void pack16_tile(int kind, const uint8_t* src, uint8_t* dst, int64_t row_bytes, int sb_bytes, bool unpack) {
    const int64_t G = row_bytes / sb_bytes;
    const int halves = pack16_halves(kind);
    std::vector<uint8_t> block((size_t)16 * sb_bytes);
    for (int64_t g = 0; g < G; g++) {
        if (unpack) {
            std::memcpy(block.data(), src + g * 16 * sb_bytes, block.size());
            pack16_bits(kind, block.data(), true);
        }
        for (int r = 0; r < 16; r++)
            for (int o = 0; o < sb_bytes;) {
                const int width = o < 2 * halves ? 2 : std::min(4, sb_bytes - o);  // a half, a dword, Q6_K's end
                const int at = kind == Q6_K ? q6_place(o) : o;
                const int64_t flat = r * row_bytes + g * sb_bytes + o, tiled = 16 * at + width * r;
                if (unpack) std::memcpy(dst + flat, block.data() + tiled, width);
                else std::memcpy(dst + g * 16 * sb_bytes + tiled, src + flat, width);
                o += width;
            }
        if (!unpack) pack16_bits(kind, dst + g * 16 * sb_bytes, false);
    }
}

void pack16(int kind, uint8_t* W, int64_t N, int64_t row_bytes, bool unpack, int threads) {
    Format f;
    format_of(kind, &f);
    const int64_t tiles = N / 16, tile_bytes = 16 * row_bytes;
    threads = (int)std::max<int64_t>(1, std::min<int64_t>(threads, tiles));
    auto task = [&](int id, int width) {
        std::vector<uint8_t> copy((size_t)tile_bytes);
        for (int64_t t = tiles * id / width; t < tiles * (id + 1) / width; t++) {
            uint8_t* tile = W + t * tile_bytes;
            std::memcpy(copy.data(), tile, (size_t)tile_bytes);
            pack16_tile(kind, copy.data(), tile, row_bytes, f.bytes, unpack);
        }
    };
    std::lock_guard<std::mutex> lock(g_call);
    if (!g_pool) g_pool = new Pool();
    g_pool->run(threads, task);
}

// Attention for R query rows of B sequences: q [B, H, R, D] (contiguous), k / v [B, Hkv, *, D] with the given strides
// (in floats), out [B, R, H, D]; row (b, r) sees counts[b * R + r] keys, at rows idx[(b * R + r) * idx_len ...] when
// idx is given, else the first ones. Query head h reads KV head h / (H / Hkv). Threads split the units (attend_group).
void attend(const float* q, const float* k, const float* v, float* out, int B, int H, int Hkv, int R, int D,
            int64_t kb, int64_t kh, int64_t ks, int64_t vb, int64_t vh, int64_t vs, const int32_t* counts,
            const int32_t* idx, int idx_len, float scale, int threads, int isa) {
    // a unit: the query heads of one row that read one KV head (all of them, or a part where the rows and KV heads
    // alone would leave a thread without a unit), computed together by attend_group
    const int groups = H / Hkv;
    int split = std::min(groups, std::max(1, (threads + B * R * Hkv - 1) / (B * R * Hkv)));
    const int per = std::min(64, (groups + split - 1) / split);  // attend_group keeps 64 heads' sums at most
    split = (groups + per - 1) / per;
    const int units = B * R * Hkv * split;
    int longest = 1;
    for (int u = 0; u < B * R; u++) longest = std::max(longest, (int)counts[u]);
    threads = std::max(1, std::min(threads, units));
    auto group_fn = portable::attend_group;
#if VS_X86
    if (isa == ISA_VNNI) group_fn = vnni::attend_group;
    else if (isa == ISA_VNNI256) group_fn = vnni256::attend_group;
    else if (isa == ISA_AVX2) group_fn = avx2::attend_group;
#endif
    auto task = [&](int id, int width) {
        std::vector<float> s((size_t)longest * per), keep((size_t)64 * per);
        const int u0 = (int)((int64_t)units * id / width), u1 = (int)((int64_t)units * (id + 1) / width);
        for (int u = u0; u < u1; u++) {
            const int part = u % split, kvh = (u / split) % Hkv, br = u / (split * Hkv), b = br / R, r = br % R;
            const int h0 = kvh * groups + part * per, G = std::min(per, groups - part * per);
            group_fn(q + (((int64_t)b * H + h0) * R + r) * D, (int64_t)R * D, k + b * kb + kvh * kh,
                     v + b * vb + kvh * vh, ks, vs, idx ? idx + (int64_t)br * idx_len : nullptr, counts[br], G, D,
                     scale, out + (((int64_t)b * R + r) * H + h0) * D, D, s.data(), keep.data());
        }
    };
    std::lock_guard<std::mutex> lock(g_call);
    if (!g_pool) g_pool = new Pool();
    g_pool->run(threads, task);
}

// ---------------------------------------------------------------------------------------------------------------
// Python module

// whether rows of this type and count can be laid out (and multiplied) 16 at a time on this CPU; else a Python error
bool pack16_ok(int kind, long long N) {
    if (N % 16 != 0) {
        PyErr_Format(PyExc_ValueError, "the 16-row layout takes a matrix of a multiple of 16 rows, "
                     "not type %d with %lld rows", kind, N);
        return false;
    }
    const bool avx512_only = kind == Q5_K || kind == Q6_K;  // AVX2 reads the 32-weight types' and Q4_K's layout
    if (g_best < ISA_AVX2 || (avx512_only && g_best != ISA_VNNI)) {
        PyErr_Format(PyExc_RuntimeError, "the 16-row layout of %s is read by %s code; this CPU's best set is %s",
                     avx512_only ? "Q5_K / Q6_K" : "this type", avx512_only ? "AVX-512 VNNI" : "AVX2",
                     ISA_NAMES[g_best]);
        return false;
    }
    return true;
}

PyObject* py_pack16(PyObject*, PyObject* args) {
    int kind, unpack, threads;
    unsigned long long wp;
    long long N, row_bytes;
    if (!PyArg_ParseTuple(args, "iKLLpi", &kind, &wp, &N, &row_bytes, &unpack, &threads)) return nullptr;
    Format f;
    if (!format_of(kind, &f) || !pack16_ok(kind, N)) return nullptr;
    if (row_bytes <= 0 || row_bytes % f.bytes != 0) {
        PyErr_Format(PyExc_ValueError, "a row of this type holds whole super-blocks of %d bytes, not %lld bytes",
                     f.bytes, row_bytes);
        return nullptr;
    }
    Py_BEGIN_ALLOW_THREADS
    pack16(kind, (uint8_t*)wp, N, row_bytes, unpack, threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

// the instruction set of a product of M rows: the 16-row tiles (AVX-512 VNNI code) where they are on for this type
// and width, whatever set the width has; else the set chosen for the width, or the one in use
int product_isa(int kind, int M, bool packed) {
    const int chosen = M >= WIDE_ROWS ? g_wide_isa : g_narrow_isa;
    if (packed && g_best != ISA_VNNI) return std::max((int)ISA_AVX2, chosen >= 0 ? chosen : g_isa);  // the 256-bit tiles
    return packed || (g_isa == ISA_VNNI && wide16_on(kind, M)) ? ISA_VNNI : chosen >= 0 ? chosen : g_isa;
}

PyObject* py_matmul(PyObject*, PyObject* args) {
    int kind, M, N, K, threads, packed = 0;
    unsigned long long xp, wp, yp, next_w = 0;
    long long row_bytes, next_n = 0, next_row_bytes = 0;
    if (!PyArg_ParseTuple(args, "iKKKiiiLi|KLLp", &kind, &xp, &wp, &yp, &M, &N, &K, &row_bytes, &threads, &next_w,
                          &next_n, &next_row_bytes, &packed))
        return nullptr;
    Format f;
    if (!format_of(kind, &f)) {
        PyErr_Format(PyExc_ValueError, "block type %d is not supported by the native kernel", kind);
        return nullptr;
    }
    if (M < 0 || N < 0 || K <= 0 || K % f.block != 0 || K % 32 != 0) {
        PyErr_Format(PyExc_ValueError, "bad shape: M=%d N=%d K=%d (K must be a multiple of %d)", M, N, K, f.block);
        return nullptr;
    }
    if (row_bytes != (long long)(K / f.block) * f.bytes) {
        PyErr_Format(PyExc_ValueError, "a weight row holds %lld bytes; K=%d of this type needs %lld", row_bytes, K,
                     (long long)(K / f.block) * f.bytes);
        return nullptr;
    }
    if (packed && !pack16_ok(kind, N)) return nullptr;
    if (M == 0 || N == 0) Py_RETURN_NONE;
    const int isa = product_isa(kind, M, packed);
    Py_BEGIN_ALLOW_THREADS
    Ahead ahead;
    ahead.w = (const uint8_t*)next_w;
    ahead.N = next_w ? next_n : 0;
    ahead.row_bytes = next_row_bytes;
    matmul(kind, (const float*)xp, (const uint8_t*)wp, (float*)yp, M, N, K, row_bytes, threads, isa, &ahead, packed);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

// RMS normalization of M rows of H floats, as transformers' Llama / Qwen2 RMSNorm computes it in float32:
// y = w * (x * (1 / sqrt(mean(x^2) + eps))). Element i's square is summed in double in lane i % 8, in order, the
// lanes combined in a fixed tree, so a row's bits depend on that row alone (not on M, the other rows or the
// instruction set).
void rms_norm(const float* x, const float* w, float* y, int64_t M, int H, float eps) {
    for (int64_t m = 0; m < M; m++) {
        const float* xr = x + m * H;
        float* yr = y + m * H;
        double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // double: the mean of squares nearly exact, at no cost worth naming
        int i = 0;
        for (; i + 8 <= H; i += 8)  // eight lanes side by side: the compiler keeps them in vectors
            for (int l = 0; l < 8; l++) acc[l] = acc[l] + (double)xr[i + l] * (double)xr[i + l];
        for (; i < H; i++) acc[i & 7] = acc[i & 7] + (double)xr[i] * (double)xr[i];
        const double sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
        const float r = 1.0f / std::sqrt((float)(sum / H) + eps);
        for (i = 0; i < H; i++) yr[i] = w[i] * (xr[i] * r);
    }
}

PyObject* py_rms_norm(PyObject*, PyObject* args) {
    unsigned long long xp, wp, yp;
    long long M;
    int H;
    float eps;
    if (!PyArg_ParseTuple(args, "KKKLif", &xp, &wp, &yp, &M, &H, &eps)) return nullptr;
    if (M < 0 || H <= 0) {
        PyErr_Format(PyExc_ValueError, "bad shape: M=%lld H=%d", M, H);
        return nullptr;
    }
    rms_norm((const float*)xp, (const float*)wp, (float*)yp, M, H, eps);
    Py_RETURN_NONE;
}

// Rotary position embedding as transformers applies it (``q * cos + rotate_half(q) * sin``, rotate_half(q) =
// cat(-q[D/2:], q[:D/2])): out[i] = x[i] * c[i] + (-x[i + D/2]) * s[i] for i < D/2, x[i] * c[i] + x[i - D/2] * s[i]
// after, each product and the sum rounded to float on its own (no fused multiply-add: -ffp-contract=off), as torch's
// three elementwise operations round them. x [B, H, R, D] with strides (xb, xh, xr, 1) in floats, cos / sin [B, R, D]
// with strides (cb, cr, 1), out [B, H, R, D] contiguous.
void rope(const float* x, int64_t xb, int64_t xh, int64_t xr, const float* c, const float* s, int64_t cb, int64_t cr,
          float* out, int B, int H, int R, int D) {
    const int h = D / 2;
    for (int b = 0; b < B; b++)
        for (int hd = 0; hd < H; hd++)
            for (int r = 0; r < R; r++) {
                const float* xv = x + b * xb + hd * xh + r * xr;
                const float* cv = c + b * cb + r * cr;
                const float* sv = s + b * cb + r * cr;
                float* o = out + (((int64_t)b * H + hd) * R + r) * D;
                for (int i = 0; i < h; i++) {
                    const float a = xv[i] * cv[i], t = -xv[i + h] * sv[i];
                    o[i] = a + t;
                }
                for (int i = h; i < D; i++) {
                    const float a = xv[i] * cv[i], t = xv[i - h] * sv[i];
                    o[i] = a + t;
                }
            }
}

PyObject* py_rope(PyObject*, PyObject* args) {
    unsigned long long xp, cp, sp, op;
    long long xb, xh, xr, cb, cr;
    int B, H, R, D;
    if (!PyArg_ParseTuple(args, "KLLLKKLLKiiii", &xp, &xb, &xh, &xr, &cp, &sp, &cb, &cr, &op, &B, &H, &R, &D))
        return nullptr;
    if (B < 0 || H < 0 || R < 0 || D <= 0 || D % 2 != 0) {
        PyErr_Format(PyExc_ValueError, "bad rotary shape: B=%d H=%d R=%d D=%d (D even)", B, H, R, D);
        return nullptr;
    }
    rope((const float*)xp, xb, xh, xr, (const float*)cp, (const float*)sp, cb, cr, (float*)op, B, H, R, D);
    Py_RETURN_NONE;
}

// A 128-bit digest of each of `rows` rows of `row_bytes` bytes (xxHash64's round on four lanes, two finalizations of
// the 256-bit state): how the blocks backend finds a matrix's rows among a file's dequantized rows by their exact
// bytes, at memory speed instead of a Python hash call a row.
inline uint64_t rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
constexpr uint64_t P1 = 11400714785074694791ULL, P2 = 14029467366897019727ULL, P3 = 1609587929392839161ULL,
                   P4 = 9650029242287828579ULL, P5 = 2870177450012600261ULL;
inline uint64_t xround(uint64_t acc, uint64_t in) { return rotl64(acc + in * P2, 31) * P1; }
inline uint64_t avalanche(uint64_t h) {
    h ^= h >> 33; h *= P2; h ^= h >> 29; h *= P3; h ^= h >> 32;
    return h;
}

void row_hashes(const uint8_t* data, int64_t rows, int64_t row_bytes, uint8_t* out) {
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t* p = data + r * row_bytes;
        uint64_t v[4] = {P1 + P2, P2, 0, 0 - P1};
        int64_t i = 0;
        for (; i + 32 <= row_bytes; i += 32)
            for (int l = 0; l < 4; l++) {
                uint64_t w;
                std::memcpy(&w, p + i + 8 * l, 8);
                v[l] = xround(v[l], w);
            }
        uint64_t tail = (uint64_t)row_bytes * P5;
        for (; i + 8 <= row_bytes; i += 8) {
            uint64_t w;
            std::memcpy(&w, p + i, 8);
            tail = rotl64(tail ^ xround(0, w), 27) * P1 + P4;
        }
        for (; i < row_bytes; i++) tail = rotl64(tail ^ (p[i] * P5), 11) * P1;
        const uint64_t a = avalanche(rotl64(v[0], 1) + rotl64(v[1], 7) + rotl64(v[2], 12) + rotl64(v[3], 18) + tail);
        const uint64_t b = avalanche((v[0] ^ rotl64(v[1], 29)) * P3 + (v[2] ^ rotl64(v[3], 41)) * P4 + (tail ^ a));
        std::memcpy(out + 16 * r, &a, 8);
        std::memcpy(out + 16 * r + 8, &b, 8);
    }
}

PyObject* py_row_hashes(PyObject*, PyObject* args) {
    unsigned long long dp, op;
    long long rows, row_bytes;
    if (!PyArg_ParseTuple(args, "KLLK", &dp, &rows, &row_bytes, &op)) return nullptr;
    if (rows < 0 || row_bytes < 0) {
        PyErr_Format(PyExc_ValueError, "bad shape: rows=%lld row_bytes=%lld", rows, row_bytes);
        return nullptr;
    }
    Py_BEGIN_ALLOW_THREADS
    row_hashes((const uint8_t*)dp, rows, row_bytes, (uint8_t*)op);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

PyObject* py_attend(PyObject*, PyObject* args) {
    unsigned long long qp, kp, vp, op, cp, ip;
    int B, H, Hkv, R, D, idx_len, threads;
    long long kb, kh, ks, vb, vh, vs;
    float scale;
    if (!PyArg_ParseTuple(args, "KKKKiiiiiLLLLLLKKifi", &qp, &kp, &vp, &op, &B, &H, &Hkv, &R, &D, &kb, &kh, &ks, &vb,
                          &vh, &vs, &cp, &ip, &idx_len, &scale, &threads))
        return nullptr;
    if (B <= 0 || R <= 0 || H <= 0 || Hkv <= 0 || H % Hkv != 0 || D <= 0 || D % 8 != 0) {
        PyErr_Format(PyExc_ValueError, "bad attention shape: B=%d H=%d Hkv=%d R=%d D=%d (D a multiple of 8, H of Hkv)",
                     B, H, Hkv, R, D);
        return nullptr;
    }
    const int isa = g_isa;
    Py_BEGIN_ALLOW_THREADS
    attend((const float*)qp, (const float*)kp, (const float*)vp, (float*)op, B, H, Hkv, R, D, kb, kh, ks, vb, vh, vs,
           (const int32_t*)cp, ip ? (const int32_t*)ip : nullptr, idx_len, scale, threads, isa);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

// ---------------------------------------------------------------------------------------------------------------
// A decoder layer's attention half in one call (verispec/backends/block_step.py): the input norm, the q / k / v
// products and their biases, the rotary embedding of q and k, the new keys and values written into the cache's
// buffers, the row attention, the output product and the residual, the second norm and the gate / up products. The
// same routines in the same order as the Python layer calls them one at a time (block_layers.LeanForward), so the
// same bits, without ~30 interpreter round trips a layer between them.

struct Product {  // one product of a layer: a matrix (siblings joined, maybe) and its bias
    int kind = 0, N = 0, K = 0;
    const uint8_t* w = nullptr;
    int64_t row_bytes = 0;
    bool packed = false;
    Ahead next;
    const float* bias = nullptr;
};

constexpr int PRODUCT_FIELDS = 10;  // kind, w, N, K, row_bytes, packed, next_w, next_N, next_row_bytes, bias

Product product_at(const int64_t* d) {
    Product p;
    p.kind = (int)d[0];
    p.w = (const uint8_t*)d[1];
    p.N = (int)d[2];
    p.K = (int)d[3];
    p.row_bytes = d[4];
    p.packed = d[5] != 0;
    p.next.w = (const uint8_t*)d[6];
    p.next.N = d[6] ? d[7] : 0;
    p.next.row_bytes = d[8];
    p.bias = (const float*)d[9];
    return p;
}

// n floats of this thread's scratch buffer `which`, kept from call to call (a layer's buffers every pass: neither
// allocated nor zeroed again; every value is written before it is read)
enum Scratch : int { S_PART, S_H, S_Y, S_Q, S_K, S_ATT, S_O, S_OWN, S_ACT, S_D, S_CHAIN, S_COUNT };
float* scratch(Scratch which, size_t n) {
    thread_local std::vector<float> bufs[S_COUNT];
    std::vector<float>& b = bufs[which];
    if (b.size() < n) b.resize(n);
    return b.data();
}

// y [M, sum of N] = the products' outputs side by side in order, each plus its bias (one rounding, as torch's add_)
void products(const Product* ps, int n, const float* x, float* y, int M, int threads) {
    int total = 0;
    for (int i = 0; i < n; i++) total += ps[i].N;
    for (int i = 0, col = 0; i < n; col += ps[i].N, i++) {
        const Product& p = ps[i];
        float* out = n > 1 ? scratch(S_PART, (size_t)M * p.N) : y;
        matmul(p.kind, x, p.w, out, M, p.N, p.K, p.row_bytes, threads, product_isa(p.kind, M, p.packed), &p.next,
               p.packed);
        if (p.bias)
            for (int64_t m = 0; m < M; m++)
                for (int j = 0; j < p.N; j++) out[m * p.N + j] = out[m * p.N + j] + p.bias[j];
        if (n > 1)
            for (int64_t m = 0; m < M; m++) std::memcpy(y + m * total + col, out + m * p.N, sizeof(float) * p.N);
    }
}

// SiLU(x) as torch's vectorized loop computes it for float32 (ATen's silu kernel: x / (1 + exp(-x)), exp from SLEEF,
// expf u10 with fused multiply-adds; torch's scalar tail calls std::exp, so callers keep their rows whole vectors):
// the per-element steps of silu_mul (simd_body.inc), for CPUs without AVX2 and FMA
inline float silu_one(float x) {
    const float d = -x;
    float e;
    if (d < -104.0f) e = 0.0f;
    else if (d > 100.0f) e = __builtin_inff();
    else if (d != d) e = d;
    else {
        const int q = (int)std::nearbyint(d * SILU_R_LN2);
        const float qf = (float)q;
        float s = std::fma(qf, -SILU_L2U, d);
        s = std::fma(qf, -SILU_L2L, s);
        e = SILU_C[0];
        for (int c = 1; c < 6; c++) e = std::fma(e, s, SILU_C[c]);
        e = 1.0f + std::fma(s * s, e, s);
        const int q1 = q >> 1, q2 = q - q1;
        e = (e * std::ldexp(1.0f, q1)) * std::ldexp(1.0f, q2);
    }
    return x / (1.0f + e);
}

// y = SiLU(g) * u for n floats (silu_mul, or silu_one where the CPU has no AVX2 and FMA, or past a multiple of 8)
void silu_mul_any(const float* g, const float* u, float* y, int64_t n) {
    int64_t done = 0;
#if VS_X86
    if (g_isa >= ISA_AVX2) {
        done = n / 8 * 8;
        avx2::silu_mul(g, u, y, done);
    }
#endif
    for (int64_t i = done; i < n; i++) y[i] = silu_one(g[i]) * u[i];
}

PyObject* py_silu_mul(PyObject*, PyObject* args) {
    unsigned long long gp, up, yp;
    long long n;
    if (!PyArg_ParseTuple(args, "KKKL", &gp, &up, &yp, &n)) return nullptr;
    if (n < 0) {
        PyErr_Format(PyExc_ValueError, "bad length %lld", n);
        return nullptr;
    }
    Py_BEGIN_ALLOW_THREADS
    silu_mul_any((const float*)gp, (const float*)up, (float*)yp, n);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

struct Front {
    const float* x;  // [B, R, Hd]
    int B, R, Hd, H, Hkv, D;
    float eps;
    const float *norm1, *norm2;
    const int64_t* desc;  // PRODUCT_FIELDS a product: n_qkv of q / k / v (in that order of columns), o, n_gu of gate / up
    int n_qkv, n_gu;
    const float *cos, *sin;  // [B or 1, R, D]
    int64_t cb;              // cos / sin's stride between sequences (0: shared)
    float *kbuf, *vbuf;      // the cache's buffers from the pass's first row: [B, Hkv, columns, D] with these strides
    int64_t kb, kh, ks, vb, vh, vs;
    const int32_t* starts;   // [B]: the first column each row writes
    const int32_t* counts;   // [B, R]: keys each query row sees (blockmm.attend)
    const int32_t* idx;      // [B, R, idx_len] or null
    int idx_len;
    float scale;
    int threads;
    float* x2;  // [B, R, Hd]: x plus the attention's output (null with out: the call's own)
    float* gu;  // [B, R, sum of gate / up's N] (null with out: the call's own)
    float* out;  // null, or [B, R, Hd]: the layer's output, x2 + down(SiLU(gate) * up) (the product after gate / up)
};

void layer_front(const Front& a) {
    const int T = a.B * a.R, D = a.D;
    std::vector<Product> ps;
    const int n_products = a.n_qkv + 1 + a.n_gu + (a.out ? 1 : 0);  // with out: down, after gate / up
    for (int i = 0; i < n_products; i++) ps.push_back(product_at(a.desc + PRODUCT_FIELDS * i));
    int Nqkv = 0;
    for (int i = 0; i < a.n_qkv; i++) Nqkv += ps[i].N;
    float *h = scratch(S_H, (size_t)T * a.Hd), *y = scratch(S_Y, (size_t)T * Nqkv);
    rms_norm(a.x, a.norm1, h, T, a.Hd, a.eps);
    products(ps.data(), a.n_qkv, h, y, T, a.threads);
    // q and k rotated from their columns of y ([B, R, heads, D] there) into [B, heads, R, D]
    float *q = scratch(S_Q, (size_t)T * a.H * D), *k = scratch(S_K, (size_t)T * a.Hkv * D),
          *att = scratch(S_ATT, (size_t)T * a.H * D);
    rope(y, (int64_t)a.R * Nqkv, D, Nqkv, a.cos, a.sin, a.cb, D, q, a.B, a.H, a.R, D);
    rope(y + (int64_t)a.H * D, (int64_t)a.R * Nqkv, D, Nqkv, a.cos, a.sin, a.cb, D, k, a.B, a.Hkv, a.R, D);
    for (int b = 0; b < a.B; b++)
        for (int g = 0; g < a.Hkv; g++)
            for (int r = 0; r < a.R; r++) {
                const int64_t col = (int64_t)a.starts[b] + r;
                std::memcpy(a.kbuf + b * a.kb + g * a.kh + col * a.ks, k + (((int64_t)b * a.Hkv + g) * a.R + r) * D,
                            sizeof(float) * D);
                std::memcpy(a.vbuf + b * a.vb + g * a.vh + col * a.vs,
                            y + ((int64_t)b * a.R + r) * Nqkv + (int64_t)(a.H + a.Hkv + g) * D, sizeof(float) * D);
            }
    attend(q, a.kbuf, a.vbuf, att, a.B, a.H, a.Hkv, a.R, D, a.kb, a.kh, a.ks, a.vb, a.vh, a.vs, a.counts,
           a.idx, a.idx_len, a.scale, a.threads, g_isa);
    float* o = scratch(S_O, (size_t)T * a.Hd);
    float *x2 = a.x2, *gu = a.gu;
    if (!x2 || !gu) {  // the call's own x2 and gate / up, where the caller left them to it
        int Ngu = 0;
        for (int i = 0; i < a.n_gu; i++) Ngu += ps[a.n_qkv + 1 + i].N;
        x2 = scratch(S_OWN, (size_t)T * (a.Hd + Ngu));
        gu = x2 + (size_t)T * a.Hd;
    }
    products(&ps[a.n_qkv], 1, att, o, T, a.threads);
    for (int64_t i = 0; i < (int64_t)T * a.Hd; i++) x2[i] = a.x[i] + o[i];
    rms_norm(x2, a.norm2, h, T, a.Hd, a.eps);
    products(ps.data() + a.n_qkv + 1, a.n_gu, h, gu, T, a.threads);
    if (!a.out) return;
    // the MLP's rest, as LeanForward computes it in torch: act = SiLU(gate) * up, x2 + down(act)
    const Product& down = ps[a.n_qkv + 1 + a.n_gu];
    const int I = down.K;
    float *act = scratch(S_ACT, (size_t)T * I), *d = scratch(S_D, (size_t)T * a.Hd);
    for (int64_t t = 0; t < T; t++) silu_mul_any(gu + t * 2 * I, gu + t * 2 * I + I, act + t * I, I);
    products(&down, 1, act, d, T, a.threads);
    for (int64_t i = 0; i < (int64_t)T * a.Hd; i++) a.out[i] = x2[i] + d[i];
}

// Whether a layer's products fit its shape (a.n_qkv q / k / v products giving (H + 2 Hkv) D columns from Hd, o from
// H D to Hd, n_gu gate / up from Hd, and with `with_down` down from half the gate / up columns to Hd); a ValueError
// set if not.
bool layer_fits(const Front& a, bool with_down) {
    if (a.B <= 0 || a.R <= 0 || a.Hd <= 0 || a.H <= 0 || a.Hkv <= 0 || a.H % a.Hkv != 0 || a.D <= 0 || a.D % 8 != 0 ||
        a.n_qkv < 1 || a.n_qkv > 3 || a.n_gu < 1 || a.n_gu > 2) {
        PyErr_Format(PyExc_ValueError, "bad layer shape: B=%d R=%d hidden=%d H=%d Hkv=%d D=%d (D a multiple of 8, H of "
                     "Hkv), %d q/k/v and %d gate/up products", a.B, a.R, a.Hd, a.H, a.Hkv, a.D, a.n_qkv, a.n_gu);
        return false;
    }
    int Nqkv = 0, Ngu = 0;
    const int last = a.n_qkv + 1 + a.n_gu;  // the down product's place (with out)
    for (int i = 0; i < last + (with_down ? 1 : 0); i++) {
        const Product p = product_at(a.desc + PRODUCT_FIELDS * i);
        Format f;
        const int in = i == a.n_qkv ? a.H * a.D : i == last ? Ngu / 2 : a.Hd;
        if (!format_of(p.kind, &f) || p.K != in || p.N <= 0 || p.row_bytes != (int64_t)(p.K / f.block) * f.bytes ||
            p.K % f.block != 0 || ((i == a.n_qkv || i == last) && p.N != a.Hd) || (i == last && Ngu % 2)) {
            PyErr_Format(PyExc_ValueError, "product %d of the layer does not fit it (type %d, %d x %d)", i, p.kind, p.N,
                         p.K);
            return false;
        }
        if (p.packed && !pack16_ok(p.kind, p.N)) return false;
        if (i < a.n_qkv) Nqkv += p.N;
        if (i > a.n_qkv && i < last) Ngu += p.N;
    }
    if (Nqkv != (a.H + 2 * a.Hkv) * a.D) {
        PyErr_Format(PyExc_ValueError, "the q/k/v products give %d columns, not (%d + 2 x %d) x %d", Nqkv, a.H, a.Hkv,
                     a.D);
        return false;
    }
    return true;
}

PyObject* py_layer_front(PyObject*, PyObject* args) {
    Front a{};
    unsigned long long x, n1, n2, desc, cs, sn, kbuf, vbuf, starts, counts, idx, x2, gu, out = 0;
    long long cb, kb, kh, ks, vb, vh, vs;
    if (!PyArg_ParseTuple(args, "KiiiiiifKKKiiKKLKKLLLLLLKKKifiKK|K", &x, &a.B, &a.R, &a.Hd, &a.H, &a.Hkv, &a.D,
                          &a.eps, &n1, &n2, &desc, &a.n_qkv, &a.n_gu, &cs, &sn, &cb, &kbuf, &vbuf, &kb, &kh, &ks, &vb,
                          &vh, &vs, &starts, &counts, &idx, &a.idx_len, &a.scale, &a.threads, &x2, &gu, &out))
        return nullptr;
    a.desc = (const int64_t*)desc;
    if (!layer_fits(a, out != 0)) return nullptr;
    a.x = (const float*)x;
    a.norm1 = (const float*)n1;
    a.norm2 = (const float*)n2;
    a.cos = (const float*)cs;
    a.sin = (const float*)sn;
    a.cb = cb;
    a.kbuf = (float*)kbuf;
    a.vbuf = (float*)vbuf;
    a.kb = kb, a.kh = kh, a.ks = ks, a.vb = vb, a.vh = vh, a.vs = vs;
    a.starts = (const int32_t*)starts;
    a.counts = (const int32_t*)counts;
    a.idx = idx ? (const int32_t*)idx : nullptr;
    a.x2 = (float*)x2;
    a.gu = (float*)gu;
    a.out = out ? (float*)out : nullptr;
    if (!a.out && (!a.x2 || !a.gu)) {
        PyErr_SetString(PyExc_ValueError, "layer_front needs x2 and gu, or out");
        return nullptr;
    }
    Py_BEGIN_ALLOW_THREADS
    layer_front(a);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

// A model's decoder layers one after another in one call (verispec/backends/block_stack.py): layer_front with its
// MLP's rest for each, the output of one the input of the next. Each layer's record (LAYER_FIELDS int64s): norm1,
// norm2, desc, n_qkv, n_gu, kbuf, vbuf, kb, kh, ks, vb, vh, vs; the shapes, the rotary tables and the rows' columns
// are the pass's, shared by every layer.
constexpr int LAYER_FIELDS = 13;

PyObject* py_layers(PyObject*, PyObject* args) {
    Front a{};
    unsigned long long x, out, records, cs, sn, starts, counts, idx;
    long long cb;
    int n_layers;
    if (!PyArg_ParseTuple(args, "KKiiiiiiffKiKKLKKKii", &x, &out, &a.B, &a.R, &a.Hd, &a.H, &a.Hkv, &a.D, &a.eps,
                          &a.scale, &records, &n_layers, &cs, &sn, &cb, &starts, &counts, &idx, &a.idx_len,
                          &a.threads))
        return nullptr;
    if (n_layers < 1 || !x || !out || !records) {
        PyErr_Format(PyExc_ValueError, "layers needs an input, an output and at least one layer (%d)", n_layers);
        return nullptr;
    }
    std::vector<Front> layers(n_layers, a);
    const int64_t* r = (const int64_t*)records;
    for (int l = 0; l < n_layers; l++, r += LAYER_FIELDS) {
        Front& f = layers[l];
        f.norm1 = (const float*)r[0];
        f.norm2 = (const float*)r[1];
        f.desc = (const int64_t*)r[2];
        f.n_qkv = (int)r[3];
        f.n_gu = (int)r[4];
        f.kbuf = (float*)r[5];
        f.vbuf = (float*)r[6];
        f.kb = r[7], f.kh = r[8], f.ks = r[9], f.vb = r[10], f.vh = r[11], f.vs = r[12];
        if (!f.norm1 || !f.norm2 || !f.desc || !f.kbuf || !f.vbuf) {
            PyErr_Format(PyExc_ValueError, "layer %d's record has a null pointer", l);
            return nullptr;
        }
        if (!layer_fits(f, true)) return nullptr;
        f.cos = (const float*)cs;
        f.sin = (const float*)sn;
        f.cb = cb;
        f.starts = (const int32_t*)starts;
        f.counts = (const int32_t*)counts;
        f.idx = idx ? (const int32_t*)idx : nullptr;
    }
    Py_BEGIN_ALLOW_THREADS
    const size_t n = (size_t)a.B * a.R * a.Hd;
    float* chain = scratch(S_CHAIN, 2 * n);  // the layers' outputs between them, two in turn
    for (int l = 0; l < n_layers; l++) {
        Front& f = layers[l];
        f.x = l == 0 ? (const float*)x : chain + ((l - 1) % 2) * n;
        f.out = l == n_layers - 1 ? (float*)out : chain + (l % 2) * n;
        layer_front(f);
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

PyObject* py_isa(PyObject*, PyObject*) { return PyUnicode_FromString(ISA_NAMES[g_isa]); }
PyObject* py_best_isa(PyObject*, PyObject*) { return PyUnicode_FromString(ISA_NAMES[g_best]); }

// The instruction set named by the single string argument, at most this CPU's best; -1 with a ValueError set if not.
int isa_argument(PyObject* args) {
    const char* name;
    if (!PyArg_ParseTuple(args, "s", &name)) return -1;
    for (int i = 0; i <= g_best; i++)
        if (std::strcmp(name, ISA_NAMES[i]) == 0) return i;
    PyErr_Format(PyExc_ValueError, "instruction set %s is not available on this CPU (best: %s)", name,
                 ISA_NAMES[g_best]);
    return -1;
}

PyObject* py_set_isa(PyObject*, PyObject* args) {
    const int i = isa_argument(args);
    if (i < 0) return nullptr;
    g_isa = i;
    g_wide_isa = g_narrow_isa = -1;  // every width on the set chosen (tests compare one set's paths whole),
    for (int& rows : g_wide16) rows = 0;  // the 16-row tiles too (AVX-512 code whatever a width's set)
    Py_RETURN_NONE;
}

PyObject* py_wide_isa(PyObject*, PyObject*) {
    return PyUnicode_FromString(ISA_NAMES[g_wide_isa >= 0 ? g_wide_isa : g_isa]);
}

PyObject* py_set_wide_isa(PyObject*, PyObject* args) {
    const int i = isa_argument(args);
    if (i < 0) return nullptr;
    g_wide_isa = i == g_isa ? -1 : i;
    Py_RETURN_NONE;
}

PyObject* py_narrow_isa(PyObject*, PyObject*) {
    return PyUnicode_FromString(ISA_NAMES[g_narrow_isa >= 0 ? g_narrow_isa : g_isa]);
}

PyObject* py_set_narrow_isa(PyObject*, PyObject* args) {
    const int i = isa_argument(args);
    if (i < 0) return nullptr;
    g_narrow_isa = i == g_isa ? -1 : i;
    Py_RETURN_NONE;
}

bool amx_usable() {
    if (g_amx < 0) g_amx = g_best == ISA_VNNI && detect_amx() ? 1 : 0;
    return g_amx == 1;
}

PyObject* py_amx_usable(PyObject*, PyObject*) { return PyBool_FromLong(amx_usable()); }

PyObject* py_amx_rows(PyObject*, PyObject* args) {
    int kind;
    if (!PyArg_ParseTuple(args, "i", &kind)) return nullptr;
    return PyLong_FromLong(is_k(kind) ? g_amx_rows[kind & 15] : 0);
}

PyObject* py_set_amx_rows(PyObject*, PyObject* args) {
    int kind, rows;
    if (!PyArg_ParseTuple(args, "ii", &kind, &rows)) return nullptr;
    if (!is_k(kind)) {
        PyErr_Format(PyExc_ValueError, "the AMX tiles take the K types (Q4_K, Q5_K, Q6_K), not block type %d", kind);
        return nullptr;
    }
    if (rows < 0) {
        PyErr_Format(PyExc_ValueError, "set_amx_rows takes 0 (off) or the fewest rows a product takes the tiles at, not %d",
                     rows);
        return nullptr;
    }
    if (rows > 0 && !amx_usable()) {
        PyErr_SetString(PyExc_ValueError, "this CPU or OS gives no AMX-INT8 tiles (an Intel Xeon from Sapphire Rapids on, "
                                          "Linux 5.16 or later): the AVX paths compute the same bits");
        return nullptr;
    }
    g_amx_rows[kind & 15] = rows;
    Py_RETURN_NONE;
}

PyObject* py_set_one_row(PyObject*, PyObject* args) {
    int kind, rows;
    if (!PyArg_ParseTuple(args, "ii", &kind, &rows)) return nullptr;
    Format f;
    if (!format_of(kind, &f) || rows < 0 || rows > one_row_most(kind)) {
        PyErr_Format(PyExc_ValueError, "set_one_row takes a block type and 0..%d rows for it, not %d and %d",
                     format_of(kind, &f) ? one_row_most(kind) : 0, kind, rows);
        return nullptr;
    }
    g_one_row[kind] = rows;
    Py_RETURN_NONE;
}

PyObject* py_set_q6k_tiles(PyObject*, PyObject* args) {
    int on;
    if (!PyArg_ParseTuple(args, "p", &on)) return nullptr;
    g_q6k_tiles = on;
    Py_RETURN_NONE;
}

PyObject* py_q6k_tiles(PyObject*, PyObject*) { return PyBool_FromLong(g_q6k_tiles); }

PyObject* py_set_wide16(PyObject*, PyObject* args) {
    int kind, rows;
    if (!PyArg_ParseTuple(args, "ii", &kind, &rows)) return nullptr;
    Format f;
    if (!format_of(kind, &f) || !is_k(kind) || rows < 0 || (rows > 0 && rows < WIDE16_MIN)) {
        PyErr_Format(PyExc_ValueError, "set_wide16 takes a K type and 0 (never) or at least %d rows, not %d and %d",
                     WIDE16_MIN, kind, rows);
        return nullptr;
    }
    g_wide16[kind] = rows;
    Py_RETURN_NONE;
}

PyObject* py_wide16(PyObject*, PyObject* args) {
    int kind;
    if (!PyArg_ParseTuple(args, "i", &kind)) return nullptr;
    return PyLong_FromLong(g_wide16[kind & 15]);
}

PyObject* py_set_prefetch(PyObject*, PyObject* args) {
    int bytes;
    if (!PyArg_ParseTuple(args, "i", &bytes)) return nullptr;
    if (bytes < 0 || bytes > (1 << 20)) {
        PyErr_Format(PyExc_ValueError, "set_prefetch takes 0..1048576 bytes, not %d", bytes);
        return nullptr;
    }
    g_prefetch = bytes;
    Py_RETURN_NONE;
}

PyObject* py_prefetch(PyObject*, PyObject*) { return PyLong_FromLong(g_prefetch); }

PyObject* py_set_packed_prefetch(PyObject*, PyObject* args) {
    int bytes;
    if (!PyArg_ParseTuple(args, "i", &bytes)) return nullptr;
    if (bytes < 0 || bytes > (1 << 20)) {
        PyErr_Format(PyExc_ValueError, "set_packed_prefetch takes 0..1048576 bytes, not %d", bytes);
        return nullptr;
    }
    g_packed_ahead = bytes;
    Py_RETURN_NONE;
}

PyObject* py_packed_prefetch(PyObject*, PyObject*) { return PyLong_FromLong(g_packed_ahead); }

PyObject* py_set_lookahead(PyObject*, PyObject* args) {
    long long own, other;
    if (!PyArg_ParseTuple(args, "LL", &own, &other)) return nullptr;
    if (own < 0 || other < 0 || own > (1LL << 26) || other > (1LL << 26)) {
        PyErr_Format(PyExc_ValueError, "set_lookahead takes 0..%lld bytes each, not %lld and %lld", 1LL << 26, own,
                     other);
        return nullptr;
    }
    std::lock_guard<std::mutex> lock(g_call);  // the workers read them between calls
    g_lookahead_own.store(own, std::memory_order_relaxed);
    g_lookahead_other.store(other, std::memory_order_relaxed);
    Py_RETURN_NONE;
}

PyObject* py_set_row_chunks(PyObject*, PyObject* args) {
    int n;
    if (!PyArg_ParseTuple(args, "i", &n)) return nullptr;
    if (n < 0 || n > 64) {
        PyErr_Format(PyExc_ValueError, "set_row_chunks takes 0..64, not %d", n);
        return nullptr;
    }
    g_row_chunks.store(n, std::memory_order_relaxed);
    Py_RETURN_NONE;
}

PyObject* py_row_chunks(PyObject*, PyObject*) { return PyLong_FromLong(g_row_chunks.load()); }

PyObject* py_lookahead(PyObject*, PyObject*) {
    return Py_BuildValue("(LL)", (long long)g_lookahead_own.load(), (long long)g_lookahead_other.load());
}

PyObject* py_one_row(PyObject*, PyObject* args) {
    int kind;
    if (!PyArg_ParseTuple(args, "i", &kind)) return nullptr;
    Format f;
    return PyLong_FromLong(format_of(kind, &f) ? g_one_row[kind & 15] : 0);
}

PyMethodDef METHODS[] = {
    {"matmul", py_matmul, METH_VARARGS,
     "matmul(kind, x_ptr, w_ptr, y_ptr, M, N, K, row_bytes, threads[, next_w, next_N, next_row_bytes, packed]): "
     "y[M, N] = x[M, K] W[N, K]^T on W's GGUF blocks; next_*: the matrix the next call will likely read "
     "(set_lookahead); packed: W laid out by pack16"},
    {"pack16", py_pack16, METH_VARARGS,
     "pack16(kind, w, N, row_bytes, unpack, threads): lay a K type's rows out 16 at a time (or back), in place"},
    {"attend", py_attend, METH_VARARGS,
     "attend(q, k, v, out, B, H, Hkv, R, D, kb, kh, ks, vb, vh, vs, counts, idx, idx_len, scale, threads): each query "
     "row's causal attention over its own keys, alone (row-invariant)"},
    {"layer_front", py_layer_front, METH_VARARGS,
     "layer_front(x, B, R, hidden, H, Hkv, D, eps, norm1, norm2, desc, n_qkv, n_gu, cos, sin, cb, kbuf, vbuf, kb, kh, "
     "ks, vb, vh, vs, starts, counts, idx, idx_len, scale, threads, x2, gu[, out]): a decoder layer's attention "
     "half and its gate / up products in one call, and with out its MLP's rest (verispec/backends/block_step.py)"},
    {"layers", py_layers, METH_VARARGS,
     "layers(x, out, B, R, hidden, H, Hkv, D, eps, scale, records, n_layers, cos, sin, cb, starts, counts, idx, "
     "idx_len, threads): decoder layers one after another in one call, each a layer_front with its MLP's rest; records "
     "[n_layers, 13] int64: norm1, norm2, desc, n_qkv, n_gu, kbuf, vbuf, kb, kh, ks, vb, vh, vs "
     "(verispec/backends/block_stack.py)"},
    {"silu_mul", py_silu_mul, METH_VARARGS,
     "silu_mul(g_ptr, u_ptr, y_ptr, n): y = SiLU(g) * u for n floats, SiLU's bits torch's (its vectorized loop)"},
    {"rms_norm", py_rms_norm, METH_VARARGS,
     "rms_norm(x_ptr, w_ptr, y_ptr, M, H, eps): y = w * (x / sqrt(mean(x^2) + eps)) per row of H floats (row-invariant)"},
    {"rope", py_rope, METH_VARARGS,
     "rope(x, xb, xh, xr, cos, sin, cb, cr, out, B, H, R, D): out = x * cos + rotate_half(x) * sin, rounded as "
     "torch rounds it"},
    {"row_hashes", py_row_hashes, METH_VARARGS,
     "row_hashes(data, rows, row_bytes, out): a 16-byte digest of each row's bytes into out (rows * 16 bytes)"},
    {"isa", py_isa, METH_NOARGS, "the instruction set in use"},
    {"set_one_row", py_set_one_row, METH_VARARGS,
     "set_one_row(kind, rows): passes of at most rows rows take the one-weight-row path for this block type (0..2 "
     "for K types, 0..1 for the 32-weight types)"},
    {"one_row", py_one_row, METH_VARARGS, "one_row(kind): the rows up to which this block type takes the one-row path"},
    {"set_q6k_tiles", py_set_q6k_tiles, METH_VARARGS,
     "set_q6k_tiles(on): AVX-512 Q6_K passes past the one-row limit on the tiles (else the buffered path)"},
    {"q6k_tiles", py_q6k_tiles, METH_NOARGS, "whether AVX-512 Q6_K passes past the one-row limit take the tiles"},
    {"set_wide16", py_set_wide16, METH_VARARGS,
     "set_wide16(kind, rows): AVX-512 VNNI passes of this K type of at least rows rows on the 16-row tiles (0: never)"},
    {"wide16", py_wide16, METH_VARARGS,
     "wide16(kind): the rows from which AVX-512 VNNI passes of this K type take the 16-row tiles (0: never)"},
    {"set_prefetch", py_set_prefetch, METH_VARARGS,
     "set_prefetch(bytes): the one-row paths request the weights this many bytes ahead (0: off)"},
    {"set_lookahead", py_set_lookahead, METH_VARARGS,
     "set_lookahead(own, other): between calls each worker fetches the first `own` bytes of its rows of the matrix the "
     "last call named as next, worker 1 also `other` bytes of the calling thread's rows (0: off)"},
    {"lookahead", py_lookahead, METH_NOARGS, "(own, other) bytes fetched ahead between calls"},
    {"set_row_chunks", py_set_row_chunks, METH_VARARGS,
     "set_row_chunks(n): calls past the one-row paths hand out their rows in about n runs a thread (0: a fixed share)"},
    {"row_chunks", py_row_chunks, METH_NOARGS, "runs of rows a thread a call past the one-row paths (0: a fixed share)"},
    {"prefetch", py_prefetch, METH_NOARGS, "the one-row paths' prefetch distance in bytes"},
    {"set_packed_prefetch", py_set_packed_prefetch, METH_VARARGS,
     "set_packed_prefetch(bytes): the 16-row layout's readers request each block this many bytes ahead (0: off)"},
    {"packed_prefetch", py_packed_prefetch, METH_NOARGS, "the 16-row layout's prefetch distance in bytes (0: off)"},
    {"best_isa", py_best_isa, METH_NOARGS, "the best instruction set this CPU runs"},
    {"set_isa", py_set_isa, METH_VARARGS, "use another instruction set (scalar, avx2, avx512vnni), at most the best"},
    {"wide_isa", py_wide_isa, METH_NOARGS, "the instruction set of products over 3 or more rows"},
    {"set_wide_isa", py_set_wide_isa, METH_VARARGS, "the instruction set of products over 3 or more rows"},
    {"narrow_isa", py_narrow_isa, METH_NOARGS, "the instruction set of products over 1 or 2 rows"},
    {"set_narrow_isa", py_set_narrow_isa, METH_VARARGS, "the instruction set of products over 1 or 2 rows"},
    {"amx_usable", py_amx_usable, METH_NOARGS, "whether this CPU and OS let the kernel use AMX-INT8 tiles"},
    {"amx_rows", py_amx_rows, METH_VARARGS, "amx_rows(kind): the fewest rows at which its products take the AMX tiles"},
    {"set_amx_rows", py_set_amx_rows, METH_VARARGS,
     "set_amx_rows(kind, rows): a K type's products of at least rows rows take the AMX tiles (0: never)"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef MODULE = {PyModuleDef_HEAD_INIT, "_native", "GGUF block matmul kernels", -1, METHODS};

}  // namespace

PyMODINIT_FUNC PyInit__native(void) {
    const char* fused = std::getenv("VERISPEC_BLOCKMM_FUSED");
    g_fused_off = fused && fused[0] == '0';
    if (const char* ahead = std::getenv("VERISPEC_AMX_AHEAD")) g_amx_ahead = std::max(0, std::atoi(ahead));
    g_best = detect_isa();
    g_isa = g_best;
    g_lookahead_own.store(default_lookahead());
    return PyModule_Create(&MODULE);
}
