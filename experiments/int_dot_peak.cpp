// The integer dot-product instructions' peak on this CPU, operands in registers: what the block kernel's inner loop
// could reach at best. Independent accumulator chains per thread (ten; six for AVX2's 16 registers); three ways to add 32 u8 x s8 products to int32
// lanes: vpmaddubsw + vpmaddwd + vpaddd (AVX2), vpmaddubsw + vpdpwssd (the K types' sub-scaled form on VNNI), and
// vpdpbusd alone (AVX-512 VL VNNI on ymm). Prints GMAC/s on 1 and 2 threads.
//
//     g++ -O2 -pthread experiments/int_dot_peak.cpp -o /tmp/int_dot_peak && /tmp/int_dot_peak
//
// The VNNI forms run only where the CPU has AVX-512 VL + VNNI (an AVX2-only CPU times the first alone). Results:
// docs/kernels.md.
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>
#define T __attribute__((target("avx2,avx512f,avx512vl,avx512vnni,avx512bw"), noinline))
#define T2 __attribute__((target("avx2"), noinline))
#define DECL(i) __m256i a##i = _mm256_set1_epi32(i), w##i = _mm256_set1_epi8(3 + seed + i);
#define OP1(i) a##i = _mm256_dpwssd_epi32(a##i, _mm256_maddubs_epi16(w##i, x), cv); __asm__("" : "+v"(a##i), "+v"(w##i));
#define OP2(i) a##i = _mm256_dpbusd_epi32(a##i, w##i, x); __asm__("" : "+v"(a##i), "+v"(w##i));
#define ALL(M) M(0) M(1) M(2) M(3) M(4) M(5) M(6) M(7) M(8) M(9)
#define SUM(i) + _mm256_extract_epi32(a##i, 0)
#define FN(name, OP) T long name(long iters, int seed) { const __m256i x0 = _mm256_set1_epi8(5), cv = _mm256_set1_epi16(7); __m256i x = x0; ALL(DECL) \
  for (long it = 0; it < iters; it++) { ALL(OP) __asm__("" : "+v"(x)); } return 0 ALL(SUM); }
#define OP0(i) a##i = _mm256_add_epi32(a##i, _mm256_madd_epi16(_mm256_maddubs_epi16(w##i, x), cv)); __asm__("" : "+x"(a##i), "+x"(w##i));
#define ALL6(M) M(0) M(1) M(2) M(3) M(4) M(5)
#define SUM6(i) + _mm256_extract_epi32(a##i, 0)
T2 long run0(long iters, int seed) { const __m256i cv = _mm256_set1_epi16(7); __m256i x = _mm256_set1_epi8(5); ALL6(DECL)
  for (long it = 0; it < iters; it++) { ALL6(OP0) __asm__("" : "+x"(x)); } return 0 ALL6(SUM6); }
FN(run1, OP1) FN(run2, OP2)
int main() {
    const bool vnni = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl");
    const long iters = 50000000;
    const char* names[] = {"maddubs+madd+add", "maddubs+dpwssd", "dpbusd"};
    for (int threads : {1, 2})
    for (int mode = 0; mode < (vnni ? 3 : 1); mode++) {
        auto t0 = std::chrono::steady_clock::now();
        std::vector<std::thread> ts;
        for (int t = 0; t < threads; t++) ts.emplace_back([=] {
            volatile long s = mode == 0 ? run0(iters, t) : mode == 1 ? run1(iters, t) : run2(iters, t); (void)s; });
        for (auto& t : ts) t.join();
        double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        printf("%d thread(s) %-18s %.1f GMAC/s\n", threads, names[mode], 32.0 * (mode ? 10 : 6) * iters * threads / s / 1e9);
    }
}
