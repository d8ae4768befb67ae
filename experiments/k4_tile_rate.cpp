// Inner-loop shapes for Q4_K's 16-row layout on AVX2 (docs/kernels.md, "2026-12-07 midday"): GMAC/s on one thread,
// weights hot in L2 (N weight rows x 1,536, 256 by default: 221 KB), integers only (no sub-scale decoding, no float
// steps). A: one 8-row half at a time, int16 sums and int32 sums in registers (the first AVX2 Q4_K tile, not merged);
// B: both 8-row halves per broadcast, int32 sums in L1 (blockmm's q4k_tile_y); C: one half, int32 sums in L1, more pass
// rows; F: FBGEMM's form (vpmaddubsw + vpmaddwd + vpaddd per 32 products). Each sum is kept a chain by an empty asm
// barrier; -DNO_CHAINS drops it, and GCC reassociates the unrolled int16 adds into a tree of live products it spills.
//
//     g++ -O3 -std=c++17 experiments/k4_tile_rate.cpp -o /tmp/k4 && /tmp/k4
//     g++ -O3 -std=c++17 -DNO_CHAINS experiments/k4_tile_rate.cpp -o /tmp/k4n && /tmp/k4n
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <vector>
#include <cstdlib>
#define T __attribute__((target("avx2,fma,f16c")))
#ifdef NO_CHAINS
#define CHAIN(...)
#else
#define CHAIN(...) __asm__("" : __VA_ARGS__)
#endif
static inline T __m256i bcast4(const int32_t* at) { __m256i v; asm("vpbroadcastd %1, %0" : "=x"(v) : "m"(*at)); return v; }
const int K = 1536, G = K / 256;
// A: one 8-row half at a time, s16 + acc in registers
template <int MT> T __attribute__((noinline)) void tileA(const uint8_t* rows, const int32_t* xt, const int32_t* sc, int32_t* out) {
    const __m256i nib = _mm256_set1_epi8(0x0F);
    for (int gi = 0; gi < G; gi++) {
        const uint8_t* b = rows + gi * 2304;
        const int32_t* x = xt + gi * 64 * MT;
        for (int h = 0; h < 2; h++) {
            const int o = 32 * h;
            __m256i acc[MT];
            for (int i = 0; i < MT; i++) acc[i] = _mm256_setzero_si256();
            #pragma GCC unroll 4
            for (int pp = 0; pp < 4; pp++) {
                #pragma GCC unroll 2
                for (int half = 0; half < 2; half++) {
                    __m256i s16[MT];
                    for (int i = 0; i < MT; i++) s16[i] = _mm256_setzero_si256();
                    #pragma GCC unroll 8
                    for (int v = 0; v < 8; v++) {
                        const __m256i q4 = _mm256_loadu_si256((const __m256i*)(b + 256 + 512 * pp + 64 * v + o));
                        const __m256i w = _mm256_and_si256(half ? _mm256_srli_epi16(q4, 4) : q4, nib);
                        for (int i = 0; i < MT; i++)
                            { s16[i] = _mm256_add_epi16(s16[i], _mm256_maddubs_epi16(w, bcast4(x + (16 * pp + 8 * half + v) * MT + i))); CHAIN("+x"(s16[i])); }
                    }
                    const __m256i sc2 = _mm256_loadu_si256((const __m256i*)(sc + 8 * (2 * pp + half)));
                    for (int i = 0; i < MT; i++) acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(s16[i], sc2));
                }
            }
            for (int i = 0; i < MT; i++) _mm256_storeu_si256((__m256i*)(out + (gi * MT + i) * 16 + 8 * h), acc[i]);
        }
    }
}
// B: both 8-row halves at once (one broadcast feeds two products), s16 in registers, int32 in memory
template <int MT> T __attribute__((noinline)) void tileB(const uint8_t* rows, const int32_t* xt, const int32_t* sc, int32_t* out) {
    const __m256i nib = _mm256_set1_epi8(0x0F);
    for (int gi = 0; gi < G; gi++) {
        const uint8_t* b = rows + gi * 2304;
        const int32_t* x = xt + gi * 64 * MT;
        alignas(32) int32_t acc[MT][16];
        for (int i = 0; i < MT; i++) { _mm256_store_si256((__m256i*)acc[i], _mm256_setzero_si256()); _mm256_store_si256((__m256i*)(acc[i] + 8), _mm256_setzero_si256()); }
        #pragma GCC unroll 1
        for (int pp = 0; pp < 4; pp++) {
            #pragma GCC unroll 2
            for (int half = 0; half < 2; half++) {
                __m256i s0[MT], s1[MT];
                for (int i = 0; i < MT; i++) s0[i] = s1[i] = _mm256_setzero_si256();
                #pragma GCC unroll 8
                for (int v = 0; v < 8; v++) {
                    const __m256i q0 = _mm256_loadu_si256((const __m256i*)(b + 256 + 512 * pp + 64 * v));
                    const __m256i q1 = _mm256_loadu_si256((const __m256i*)(b + 256 + 512 * pp + 64 * v + 32));
                    const __m256i w0 = _mm256_and_si256(half ? _mm256_srli_epi16(q0, 4) : q0, nib);
                    const __m256i w1 = _mm256_and_si256(half ? _mm256_srli_epi16(q1, 4) : q1, nib);
                    for (int i = 0; i < MT; i++) {
                        const __m256i xb = bcast4(x + (16 * pp + 8 * half + v) * MT + i);
                        s0[i] = _mm256_add_epi16(s0[i], _mm256_maddubs_epi16(w0, xb));
                        s1[i] = _mm256_add_epi16(s1[i], _mm256_maddubs_epi16(w1, xb)); CHAIN("+x"(s0[i]), "+x"(s1[i]));
                    }
                }
                const __m256i c0 = _mm256_loadu_si256((const __m256i*)(sc + 8 * (2 * pp + half)));
                const __m256i c1 = _mm256_loadu_si256((const __m256i*)(sc + 64 + 8 * (2 * pp + half)));
                for (int i = 0; i < MT; i++) {
                    _mm256_store_si256((__m256i*)acc[i], _mm256_add_epi32(_mm256_load_si256((__m256i*)acc[i]), _mm256_madd_epi16(s0[i], c0)));
                    _mm256_store_si256((__m256i*)(acc[i] + 8), _mm256_add_epi32(_mm256_load_si256((__m256i*)(acc[i] + 8)), _mm256_madd_epi16(s1[i], c1)));
                }
            }
        }
        for (int i = 0; i < MT; i++) std::memcpy(out + (gi * MT + i) * 16, acc[i], 64);
    }
}
// C: one half at a time, s16 in registers, int32 in memory (more rows)
template <int MT> T __attribute__((noinline)) void tileC(const uint8_t* rows, const int32_t* xt, const int32_t* sc, int32_t* out) {
    const __m256i nib = _mm256_set1_epi8(0x0F);
    for (int gi = 0; gi < G; gi++) {
        const uint8_t* b = rows + gi * 2304;
        const int32_t* x = xt + gi * 64 * MT;
        for (int h = 0; h < 2; h++) {
            const int o = 32 * h;
            alignas(32) int32_t acc[MT][8];
            for (int i = 0; i < MT; i++) _mm256_store_si256((__m256i*)acc[i], _mm256_setzero_si256());
            #pragma GCC unroll 1
            for (int pp = 0; pp < 4; pp++) {
                #pragma GCC unroll 2
                for (int half = 0; half < 2; half++) {
                    __m256i s16[MT];
                    for (int i = 0; i < MT; i++) s16[i] = _mm256_setzero_si256();
                    #pragma GCC unroll 8
                    for (int v = 0; v < 8; v++) {
                        const __m256i q4 = _mm256_loadu_si256((const __m256i*)(b + 256 + 512 * pp + 64 * v + o));
                        const __m256i w = _mm256_and_si256(half ? _mm256_srli_epi16(q4, 4) : q4, nib);
                        for (int i = 0; i < MT; i++)
                            { s16[i] = _mm256_add_epi16(s16[i], _mm256_maddubs_epi16(w, bcast4(x + (16 * pp + 8 * half + v) * MT + i))); CHAIN("+x"(s16[i])); }
                    }
                    const __m256i sc2 = _mm256_loadu_si256((const __m256i*)(sc + 8 * (2 * pp + half)));
                    for (int i = 0; i < MT; i++) _mm256_store_si256((__m256i*)acc[i], _mm256_add_epi32(_mm256_load_si256((__m256i*)acc[i]), _mm256_madd_epi16(s16[i], sc2)));
                }
            }
            for (int i = 0; i < MT; i++) std::memcpy(out + (gi * MT + i) * 16 + 8 * h, acc[i], 32);
        }
    }
}
// F: FBGEMM-like: bcast, maddubs, madd ones, add per 32 MAC, one half at a time (int32 in registers)
template <int MT> T __attribute__((noinline)) void tileF(const uint8_t* rows, const int32_t* xt, const int32_t* sc, int32_t* out) {
    const __m256i nib = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    for (int gi = 0; gi < G; gi++) {
        const uint8_t* b = rows + gi * 2304;
        const int32_t* x = xt + gi * 64 * MT;
        for (int h = 0; h < 2; h++) {
            const int o = 32 * h;
            __m256i acc[MT];
            for (int i = 0; i < MT; i++) acc[i] = _mm256_setzero_si256();
            #pragma GCC unroll 1
            for (int pp = 0; pp < 4; pp++)
                #pragma GCC unroll 2
                for (int half = 0; half < 2; half++)
                    #pragma GCC unroll 8
                    for (int v = 0; v < 8; v++) {
                        const __m256i q4 = _mm256_loadu_si256((const __m256i*)(b + 256 + 512 * pp + 64 * v + o));
                        const __m256i w = _mm256_and_si256(half ? _mm256_srli_epi16(q4, 4) : q4, nib);
                        for (int i = 0; i < MT; i++)
                            { acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(_mm256_maddubs_epi16(w, bcast4(x + (16 * pp + 8 * half + v) * MT + i)), ones)); CHAIN("+x"(acc[i])); }
                    }
            for (int i = 0; i < MT; i++) _mm256_storeu_si256((__m256i*)(out + (gi * MT + i) * 16 + 8 * h), acc[i]);
        }
    }
}
typedef void (*Fn)(const uint8_t*, const int32_t*, const int32_t*, int32_t*);
int main(int argc, char** argv) {
    const int N = argc > 1 ? atoi(argv[1]) : 256;  // weight rows (hot: 256 x 864 B = 221 KB)
    std::vector<uint8_t> W((size_t)N / 16 * G * 2304);
    for (auto& c : W) c = rand();
    std::vector<int32_t> X(16 * K / 4), S(128), O(16 * G * 16 * 4);
    for (auto& c : X) c = rand() & 0x3f3f3f3f;
    for (auto& c : S) c = 0x00050005;
    struct V { const char* name; Fn f; int mt; } vs[] = {
        {"A4", tileA<4>, 4}, {"A5", tileA<5>, 5}, {"A6", tileA<6>, 6},
        {"B4", tileB<4>, 4}, {"B5", tileB<5>, 5}, {"B6", tileB<6>, 6},
        {"C4", tileC<4>, 4}, {"C8", tileC<8>, 8}, {"C12", tileC<12>, 12},
        {"F4", tileF<4>, 4}, {"F8", tileF<8>, 8}, {"F12", tileF<12>, 12}};
    for (int round = 0; round < 2; round++)
    for (auto& v : vs) {
        const int reps = 40;
        double best = 1e9;
        for (int r = 0; r < 5; r++) {
            auto t0 = std::chrono::steady_clock::now();
            for (int rep = 0; rep < reps; rep++)
                for (int n = 0; n < N; n += 16) v.f(W.data() + (size_t)n / 16 * G * 2304, X.data(), S.data(), O.data());
            double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
            if (s < best) best = s;
        }
        const double macs = (double)reps * N * K * v.mt;
        printf("%-4s MT=%2d %6.1f GMAC/s  (%.2f ns per 16x256 x row)\n", v.name, v.mt, macs / best / 1e9, best / reps / (N / 16.0 * G * v.mt) * 1e9);
    }
}
