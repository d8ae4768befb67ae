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
// Every float operation is one IEEE rounding in a fixed order (built with -ffp-contract=off: no fused multiply-add),
// so row i of y depends on row i of x and on W alone: not on M, not on the other rows, not on the thread count,
// and not on which instruction set ran it (the scalar, AVX2 and VNNI paths give the same bits).
//
// Instruction sets are chosen at run time (__builtin_cpu_supports): AVX-512 VNNI / AVX-VNNI, else AVX2 + FMA, else
// portable scalar code. Threads split the output columns (W's rows); each thread unpacks its own rows.

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#define VS_X86 1
#include <immintrin.h>
#else
#define VS_X86 0
#endif

namespace {

// ---------------------------------------------------------------------------------------------------------------
// Block formats (ggml's layouts; ids are ggml's type numbers)

enum Kind : int { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

struct Format {
    int block;      // weights per block
    int bytes;      // bytes per block
    bool is_signed; // unpacked integers are signed (else 0..31)
    bool sub16;     // integer sub-scales per 16 weights (Q6_K)
};

bool format_of(int kind, Format* f) {
    switch (kind) {
        case Q4_0: *f = {32, 18, false, false}; return true;
        case Q4_1: *f = {32, 20, false, false}; return true;
        case Q5_0: *f = {32, 22, false, false}; return true;
        case Q8_0: *f = {32, 34, true, false}; return true;
        case Q4_K: *f = {256, 144, false, false}; return true;
        case Q5_K: *f = {256, 176, false, false}; return true;
        case Q6_K: *f = {256, 210, true, true}; return true;
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

inline void scale_min_k4(int j, const uint8_t* q, int* d, int* m) {
    if (j < 4) {
        *d = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// One group unpacked: 8 chunks of 32 weights.
struct Group {
    alignas(64) int8_t w[256];
    alignas(32) float A[8];
    alignas(32) float B[8];
    alignas(32) int16_t c[16];  // Q6_K's sub-scales, one per 16 weights
    int chunks;                 // 1..8 (a tail group of a 32-weight type may hold fewer)
};

// The factors of a group (scalar: at most 8 per 256 weights), shared by every instruction set.
void group_factors(int kind, const uint8_t* src, int chunks, Group* g) {
    for (int j = 0; j < 8; j++) { g->A[j] = 0.0f; g->B[j] = 0.0f; }
    switch (kind) {
        case Q4_0: case Q5_0: case Q8_0: case Q4_1: {
            const int bytes = kind == Q4_0 ? 18 : kind == Q4_1 ? 20 : kind == Q5_0 ? 22 : 34;
            for (int j = 0; j < chunks; j++) {
                const uint8_t* b = src + j * bytes;
                const float d = rd_half(b);
                g->A[j] = d;
                g->B[j] = kind == Q4_0 ? -8.0f * d : kind == Q5_0 ? -16.0f * d : kind == Q4_1 ? rd_half(b + 2) : 0.0f;
            }
            break;
        }
        case Q4_K: case Q5_K: {
            const float d = rd_half(src), dmin = rd_half(src + 2);
            for (int j = 0; j < 8; j++) {
                int sc, mn;
                scale_min_k4(j, src + 4, &sc, &mn);
                g->A[j] = d * (float)sc;
                g->B[j] = -(dmin * (float)mn);
            }
            break;
        }
        case Q6_K: {
            const float d = rd_half(src + 208);
            const int8_t* sc = (const int8_t*)(src + 192);
            for (int j = 0; j < 8; j++) g->A[j] = d;
            for (int j = 0; j < 16; j++) g->c[j] = sc[j];
            break;
        }
    }
    g->chunks = chunks;
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

// Activations of one row, quantized per 32 values.
struct Acts {
    const int8_t* q;   // [K]
    const float* dx;   // [K / 32]
    const float* sx;   // [K / 32]
};

void quantize_row(const float* x, int K, int8_t* q, float* dx, float* sx) {
    for (int c = 0; c < K / 32; c++) {
        const float* v = x + 32 * c;
        float amax = 0.0f;
        for (int i = 0; i < 32; i++) amax = std::max(amax, std::fabs(v[i]));
        const float d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        int sum = 0;
        for (int i = 0; i < 32; i++) {
            float r = std::nearbyint(v[i] * id);  // round half to even (the default rounding mode)
            r = std::min(127.0f, std::max(-127.0f, r));
            q[32 * c + i] = (int8_t)r;
            sum += (int)r;
        }
        dx[c] = d;
        sx[c] = d * (float)sum;
    }
}

// The float part of a group, the same on every path: eight exact integer sums in, the accumulators updated.
inline void accumulate_scalar(const int32_t* s, const Group& g, const float* dx, const float* sx, float* acc) {
    for (int j = 0; j < 8; j++) {
        const float t = g.A[j] * dx[j];
        const float u = (float)s[j] * t;
        acc[j] = acc[j] + u;
        const float v = g.B[j] * sx[j];
        acc[j] = acc[j] + v;
    }
}

inline float lanes_sum(const float* a) {
    return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

void dots_scalar(const Group& g, const int8_t* q, int32_t* s) {
    for (int j = 0; j < 8; j++) {
        int32_t sum = 0;
        if (j < g.chunks) {
            for (int i = 0; i < 32; i++) {
                const int k = 32 * j + i;
                sum += (int32_t)g.w[k] * (int32_t)q[k];
            }
        }
        s[j] = sum;
    }
}

void dots_scalar_sub16(const Group& g, const int8_t* q, int32_t* s) {
    for (int j = 0; j < 8; j++) {
        int32_t sum = 0;
        for (int h = 0; h < 2; h++) {
            int32_t part = 0;
            for (int i = 0; i < 16; i++) {
                const int k = 32 * j + 16 * h + i;
                part += (int32_t)g.w[k] * (int32_t)q[k];
            }
            sum += part * (int32_t)g.c[2 * j + h];
        }
        s[j] = sum;
    }
}

// ---------------------------------------------------------------------------------------------------------------
// The work of one thread: output columns [n0, n1) for every row.

struct Problem {
    int kind;
    Format f;
    int M, N, K;
    int64_t row_bytes;
    const uint8_t* W;
    const int8_t* qx;
    const float* dx;
    const float* sx;
    float* y;
};

constexpr int NR = 4;  // weight rows unpacked together: each activation chunk loaded once serves NR rows

#if VS_X86
// The SIMD paths: one body (simd_body.inc) compiled for each instruction set, each function marked with its target so
// the rest of the library stays baseline x86-64 and runs on any CPU.
#define VS_TARGET __attribute__((target("avx2,fma,f16c")))
#define VS_USE_VNNI 0
namespace avx2 {
#include "simd_body.inc"
}
#undef VS_TARGET
#undef VS_USE_VNNI
#define VS_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))
#define VS_USE_VNNI 1
namespace vnni {
#include "simd_body.inc"
}
#undef VS_TARGET
#undef VS_USE_VNNI
#endif  // VS_X86

// ---------------------------------------------------------------------------------------------------------------
// Instruction set choice

enum Isa : int { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_VNNI = 2 };
const char* ISA_NAMES[] = {"scalar", "avx2", "avx512vnni"};

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

int g_best = -1;
int g_isa = -1;

void run_range_any(const Problem& p, int n0, int n1, int isa, int64_t q_stride) {
#if VS_X86
    const bool sg = p.f.is_signed, s16 = p.f.sub16;
    if (isa == ISA_VNNI) {
        if (!sg) return vnni::accumulate_range<false, false>(p, n0, n1, q_stride);
        return s16 ? vnni::accumulate_range<true, true>(p, n0, n1, q_stride)
                   : vnni::accumulate_range<true, false>(p, n0, n1, q_stride);
    }
    if (isa == ISA_AVX2) {
        if (!sg) return avx2::accumulate_range<false, false>(p, n0, n1, q_stride);
        return s16 ? avx2::accumulate_range<true, true>(p, n0, n1, q_stride)
                   : avx2::accumulate_range<true, false>(p, n0, n1, q_stride);
    }
#endif
    // scalar: the padded activation layout is the same, so the portable loop reads it the same way
    const int C = p.K / 32, G = (C + 7) / 8, Cp = G * 8;
    const int per_group_src = p.f.block == 32 ? 8 : 1;
    std::vector<Group> buf((size_t)G);
    alignas(32) int32_t s[8];
    for (int n = n0; n < n1; n++) {
        const uint8_t* row = p.W + (int64_t)n * p.row_bytes;
        for (int gi = 0; gi < G; gi++)
            unpack_scalar(p.kind, row + (int64_t)gi * per_group_src * p.f.bytes, std::min(8, C - 8 * gi), &buf[gi]);
        for (int m = 0; m < p.M; m++) {
            float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            const int8_t* qx = p.qx + (int64_t)m * q_stride;
            for (int gi = 0; gi < G; gi++) {
                if (p.f.sub16) dots_scalar_sub16(buf[gi], qx + 256 * (int64_t)gi, s);
                else dots_scalar(buf[gi], qx + 256 * (int64_t)gi, s);
                accumulate_scalar(s, buf[gi], p.dx + (int64_t)m * Cp + 8 * gi, p.sx + (int64_t)m * Cp + 8 * gi, acc);
            }
            p.y[(int64_t)m * p.N + n] = lanes_sum(acc);
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------
// A small pool of threads that spin briefly between calls (a decoding pass makes ~200 calls in a row), then sleep.

class Pool {
  public:
    ~Pool() {
        {
            std::lock_guard<std::mutex> lock(mu_);
            stop_ = true;
            gen_.fetch_add(1);
        }
        cv_.notify_all();
        for (auto& t : workers_) t.join();
    }

    void run(int threads, const std::function<void(int, int)>& task) {
        if (threads <= 1) { task(0, 1); return; }
        grow(threads - 1);
        task_ = &task;
        width_ = threads;
        pending_.store(threads - 1, std::memory_order_relaxed);
        {
            std::lock_guard<std::mutex> lock(mu_);
            gen_.fetch_add(1, std::memory_order_release);
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
            if (id < width_) {
                (*task_)(id, width_);
                pending_.fetch_sub(1, std::memory_order_acq_rel);
            }
        }
    }

    std::vector<std::thread> workers_;
    std::atomic<uint64_t> gen_{0};
    std::atomic<int> pending_{0};
    const std::function<void(int, int)>* volatile task_ = nullptr;
    volatile int width_ = 1;
    std::mutex mu_;
    std::condition_variable cv_;
    bool stop_ = false;
};

Pool* g_pool = nullptr;
std::mutex g_call;  // one call at a time uses the pool (callers in several Python threads take turns)

// pending_ must count only the workers that take part: workers with id >= width still wake and skip
// (they do not decrement), so the pool is always run with every worker taking part.

void matmul(int kind, const float* x, const uint8_t* W, float* y, int M, int N, int K, int64_t row_bytes,
            int threads, int isa) {
    Format f;
    format_of(kind, &f);
    const int C = K / 32, G = (C + 7) / 8, Cp = 8 * G;
    const int64_t stride = 256 * (int64_t)G;  // each row's quantized activations padded to whole groups
    std::vector<int8_t> qx((size_t)M * stride, 0);
    std::vector<float> dx((size_t)M * Cp, 0.0f), sx((size_t)M * Cp, 0.0f);
    for (int m = 0; m < M; m++)
        quantize_row(x + (int64_t)m * K, K, qx.data() + m * stride, dx.data() + (int64_t)m * Cp,
                     sx.data() + (int64_t)m * Cp);
    Problem p{kind, f, M, N, K, row_bytes, W, qx.data(), dx.data(), sx.data(), y};
    // split W's rows into runs of NR, as evenly as possible
    const int units = (N + NR - 1) / NR;
    threads = std::max(1, std::min(threads, units));
    auto task = [&](int id, int width) {
        const int u0 = (int)((int64_t)units * id / width), u1 = (int)((int64_t)units * (id + 1) / width);
        const int n0 = std::min(N, u0 * NR), n1 = std::min(N, u1 * NR);
        if (n0 < n1) run_range_any(p, n0, n1, isa, stride);
    };
    std::lock_guard<std::mutex> lock(g_call);
    if (!g_pool) g_pool = new Pool();
    g_pool->run(threads, task);
}

// ---------------------------------------------------------------------------------------------------------------
// Python module

PyObject* py_matmul(PyObject*, PyObject* args) {
    int kind, M, N, K, threads;
    unsigned long long xp, wp, yp;
    long long row_bytes;
    if (!PyArg_ParseTuple(args, "iKKKiiiLi", &kind, &xp, &wp, &yp, &M, &N, &K, &row_bytes, &threads)) return nullptr;
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
    if (M == 0 || N == 0) Py_RETURN_NONE;
    const int isa = g_isa;
    Py_BEGIN_ALLOW_THREADS
    matmul(kind, (const float*)xp, (const uint8_t*)wp, (float*)yp, M, N, K, row_bytes, threads, isa);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

PyObject* py_isa(PyObject*, PyObject*) { return PyUnicode_FromString(ISA_NAMES[g_isa]); }
PyObject* py_best_isa(PyObject*, PyObject*) { return PyUnicode_FromString(ISA_NAMES[g_best]); }

PyObject* py_set_isa(PyObject*, PyObject* args) {
    const char* name;
    if (!PyArg_ParseTuple(args, "s", &name)) return nullptr;
    for (int i = 0; i <= g_best; i++)
        if (std::strcmp(name, ISA_NAMES[i]) == 0) {
            g_isa = i;
            Py_RETURN_NONE;
        }
    PyErr_Format(PyExc_ValueError, "instruction set %s is not available on this CPU (best: %s)", name,
                 ISA_NAMES[g_best]);
    return nullptr;
}

PyMethodDef METHODS[] = {
    {"matmul", py_matmul, METH_VARARGS,
     "matmul(kind, x_ptr, w_ptr, y_ptr, M, N, K, row_bytes, threads): y[M, N] = x[M, K] W[N, K]^T on W's GGUF blocks"},
    {"isa", py_isa, METH_NOARGS, "the instruction set in use"},
    {"best_isa", py_best_isa, METH_NOARGS, "the best instruction set this CPU runs"},
    {"set_isa", py_set_isa, METH_VARARGS, "use another instruction set (scalar, avx2, avx512vnni), at most the best"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef MODULE = {PyModuleDef_HEAD_INIT, "_native", "GGUF block matmul kernels", -1, METHODS};

}  // namespace

PyMODINIT_FUNC PyInit__native(void) {
    g_best = detect_isa();
    g_isa = g_best;
    return PyModule_Create(&MODULE);
}
