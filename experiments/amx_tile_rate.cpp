// What an AMX path for wide passes could multiply on a CPU with AMX-INT8 (docs/kernels.md, "The same Intel Sapphire
// Rapids VM ... 2026-12-04"): a Q4_K-shaped product y = x W^T at M = 1..16 rows, with each 32-weight chunk's integer
// dot taken whole by a tile product (tdpbsud: the activations' signed bytes times the weights' unsigned nibbles),
// then multiplied by its integer sub-scale and summed per 256-weight super-block in int32 (with the minimums' term),
// then one float step per super-block: the arithmetic the block kernel took on 2026-12-04 (its AMX path,
// verispec/blockmm/amx_body.inc, unpacks the file's own blocks instead). Weights are held repacked for the tiles (the same nibbles in another order, the file's size), read once per
// call; matrices small enough to stay in the caches, one thread; checked against a scalar computation first. A
// super-block's eight chunks are unpacked first, then multiplied four C tiles a round (a first version with one tile
// product a chunk, stored and read back at once, ran 8 rows at ~80 GMAC/s against ~110 for this one).
//
//     g++ -O2 -march=native experiments/amx_tile_rate.cpp -o /tmp/amx_rate && /tmp/amx_rate
#if !defined(__AMX_INT8__) || !defined(__AVX512F__)
#error "this measures AMX-INT8 tile products: build it with -march=native on a CPU with AMX (an Intel Xeon from Sapphire Rapids on)"
#endif
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

struct TileConfig {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

// W: N x K weights 0..15 (Q4_K nibbles), packed per 16 rows x 32 columns as one B tile (8 rows x 64 bytes: row r holds
// bytes 4r..4r+3 of the chunk for each of the 16 weight rows), two tile bytes a packed byte (b[j] | b[j + 256] << 4)
struct Packed {
    int N, K;
    std::vector<uint8_t> tiles;  // [N/16][K/32][256]
    std::vector<uint8_t> sc;     // [N/16][K/32][16] sub-scales, 6 bits
    std::vector<uint8_t> mn;     // [N/16][K/32][16] minimums, 6 bits
    std::vector<float> d, dmin;  // [N/16][K/256][16]
};

Packed pack(const std::vector<uint8_t>& w, const std::vector<uint8_t>& sc, const std::vector<uint8_t>& mn,
            const std::vector<float>& d, const std::vector<float>& dmin, int N, int K) {
    Packed p{N, K};
    const int C = K / 32, G = K / 256;
    p.tiles.resize((size_t)N / 16 * C * 256);
    p.sc.resize((size_t)N / 16 * C * 16);
    p.mn.resize((size_t)N / 16 * C * 16);
    p.d.resize((size_t)N / 16 * G * 16);
    p.dmin.resize((size_t)N / 16 * G * 16);
    for (int nb = 0; nb < N / 16; nb++) {
        for (int c = 0; c < C; c++) {
            uint8_t b[512];
            for (int r = 0; r < 8; r++)
                for (int n = 0; n < 16; n++)
                    for (int t = 0; t < 4; t++) b[r * 64 + 4 * n + t] = w[(size_t)(nb * 16 + n) * K + 32 * c + 4 * r + t];
            uint8_t* out = &p.tiles[((size_t)nb * C + c) * 256];
            for (int j = 0; j < 256; j++) out[j] = (uint8_t)(b[j] | (b[j + 256] << 4));
            for (int n = 0; n < 16; n++) {
                p.sc[((size_t)nb * C + c) * 16 + n] = sc[(size_t)(nb * 16 + n) * C + c];
                p.mn[((size_t)nb * C + c) * 16 + n] = mn[(size_t)(nb * 16 + n) * C + c];
            }
        }
        for (int g = 0; g < G; g++)
            for (int n = 0; n < 16; n++) {
                p.d[((size_t)nb * G + g) * 16 + n] = d[(size_t)(nb * 16 + n) * G + g];
                p.dmin[((size_t)nb * G + g) * 16 + n] = dmin[(size_t)(nb * 16 + n) * G + g];
            }
    }
    return p;
}

// q: M x K int8 activations, dx: M x G factors, bsum: M x C sums of q per chunk; y: M x N
void amx_matmul(const Packed& p, const int8_t* q, const float* dx, const int32_t* bsum, int M, float* y) {
    const int K = p.K, C = K / 32, G = K / 256;
    TileConfig cfg;
    for (int t = 0; t < 4; t++) cfg.rows[t] = (uint8_t)M, cfg.colsb[t] = 64;  // C: M x 16 int32, four chunks
    for (int t = 4; t < 8; t += 2) {
        cfg.rows[t] = (uint8_t)M, cfg.colsb[t] = 32;  // A: M x 32 bytes
        cfg.rows[t + 1] = 8, cfg.colsb[t + 1] = 64;   // B: 8 x 64 bytes
    }
    _tile_loadconfig(&cfg);
    alignas(64) uint8_t b[8 * 512];
    alignas(64) int32_t ct[4 * 16 * 16];
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int nb = 0; nb < p.N / 16; nb++) {
        __m512 acc[16];
        for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
        for (int g = 0; g < G; g++) {
            __m512i isum[16], imin[16];
            for (int m = 0; m < M; m++) isum[m] = imin[m] = _mm512_setzero_si512();
            // a super-block's eight chunks: all unpacked first, then eight tile products into four C tiles (two
            // rounds), so that no tile load waits on the stores just before it
            for (int h = 0; h < 8; h++) {
                const uint8_t* src = &p.tiles[((size_t)nb * C + g * 8 + h) * 256];
                for (int j = 0; j < 256; j += 64) {
                    const __m512i v = _mm512_loadu_si512(src + j);
                    _mm512_store_si512(b + 512 * h + j, _mm512_and_si512(v, low));
                    _mm512_store_si512(b + 512 * h + 256 + j, _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
                }
            }
            for (int half = 0; half < 2; half++) {
                const int c0 = g * 8 + 4 * half;
                const uint8_t* bb = b + 512 * 4 * half;
                _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                _tile_loadd(4, q + 32 * c0, K); _tile_loadd(5, bb, 64); _tile_dpbsud(0, 4, 5);
                _tile_loadd(6, q + 32 * (c0 + 1), K); _tile_loadd(7, bb + 512, 64); _tile_dpbsud(1, 6, 7);
                _tile_loadd(4, q + 32 * (c0 + 2), K); _tile_loadd(5, bb + 1024, 64); _tile_dpbsud(2, 4, 5);
                _tile_loadd(6, q + 32 * (c0 + 3), K); _tile_loadd(7, bb + 1536, 64); _tile_dpbsud(3, 6, 7);
                _tile_stored(0, ct, 64); _tile_stored(1, ct + 256, 64);
                _tile_stored(2, ct + 512, 64); _tile_stored(3, ct + 768, 64);
                for (int t = 0; t < 4; t++) {
                    const int c = c0 + t;
                    const __m512i s = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)&p.sc[((size_t)nb * C + c) * 16]));
                    const __m512i mn = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)&p.mn[((size_t)nb * C + c) * 16]));
                    for (int m = 0; m < M; m++) {
                        isum[m] = _mm512_add_epi32(isum[m], _mm512_mullo_epi32(_mm512_load_si512(ct + 256 * t + 16 * m), s));
                        imin[m] = _mm512_add_epi32(imin[m], _mm512_mullo_epi32(mn, _mm512_set1_epi32(bsum[m * C + c])));
                    }
                }
            }
            const __m512 d = _mm512_loadu_ps(&p.d[((size_t)nb * G + g) * 16]);
            const __m512 dm = _mm512_loadu_ps(&p.dmin[((size_t)nb * G + g) * 16]);
            for (int m = 0; m < M; m++) {
                const __m512 f = _mm512_set1_ps(dx[m * G + g]);
                acc[m] = _mm512_add_ps(acc[m], _mm512_mul_ps(_mm512_cvtepi32_ps(isum[m]), _mm512_mul_ps(d, f)));
                acc[m] = _mm512_sub_ps(acc[m], _mm512_mul_ps(_mm512_cvtepi32_ps(imin[m]), _mm512_mul_ps(dm, f)));
            }
        }
        for (int m = 0; m < M; m++) _mm512_storeu_ps(y + (size_t)m * p.N + nb * 16, acc[m]);
    }
    _tile_release();
}

int main() {
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) != 0) {
        std::puts("this kernel refuses the AMX tile state; nothing to measure");
        return 1;
    }
    std::mt19937 rng(0);
    const int shapes[][2] = {{8960, 1536}, {1536, 8960}, {2048, 1536}};
    for (const auto& shape : shapes) {
        const int N = shape[0], K = shape[1], C = K / 32, G = K / 256;
        std::vector<uint8_t> w((size_t)N * K), sc((size_t)N * C), mn((size_t)N * C);
        std::vector<float> d((size_t)N * G), dmin((size_t)N * G);
        for (auto& v : w) v = rng() & 15;
        for (auto& v : sc) v = rng() & 63;
        for (auto& v : mn) v = rng() & 63;
        for (auto& v : d) v = 1e-3f * (1 + rng() % 100);
        for (auto& v : dmin) v = 1e-4f * (1 + rng() % 100);
        const Packed p = pack(w, sc, mn, d, dmin, N, K);
        for (int M : {1, 4, 8, 16}) {
            std::vector<int8_t> q((size_t)M * K);
            std::vector<float> dx((size_t)M * G), y((size_t)M * N);
            std::vector<int32_t> bsum((size_t)M * C, 0);
            for (auto& v : q) v = (int8_t)((int)(rng() % 255) - 127);
            for (auto& v : dx) v = 1e-2f * (1 + rng() % 10);
            for (int m = 0; m < M; m++)
                for (int k = 0; k < K; k++) bsum[m * C + k / 32] += q[(size_t)m * K + k];
            amx_matmul(p, q.data(), dx.data(), bsum.data(), M, y.data());
            // check a few outputs against the same arithmetic in scalar code (integers exact; floats in the same order)
            for (int m = 0; m < M; m++)
                for (int n = 0; n < N; n += N / 7) {
                    float acc = 0;
                    for (int g = 0; g < G; g++) {
                        int32_t is = 0, im = 0;
                        for (int c = 8 * g; c < 8 * g + 8; c++) {
                            int32_t s = 0;
                            for (int k = 32 * c; k < 32 * c + 32; k++) s += q[(size_t)m * K + k] * w[(size_t)n * K + k];
                            is += sc[(size_t)n * C + c] * s;
                            im += mn[(size_t)n * C + c] * bsum[m * C + c];
                        }
                        const float f = dx[m * G + g];
                        acc = acc + (float)is * (d[(size_t)n * G + g] * f);
                        acc = acc - (float)im * (dmin[(size_t)n * G + g] * f);
                    }
                    if (acc != y[(size_t)m * N + n]) {
                        std::printf("mismatch at M=%d m=%d n=%d: %g against %g\n", M, m, n, y[(size_t)m * N + n], acc);
                        return 1;
                    }
                }
            const int rounds = 50;
            auto t0 = std::chrono::steady_clock::now();
            for (int r = 0; r < rounds; r++) amx_matmul(p, q.data(), dx.data(), bsum.data(), M, y.data());
            const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / rounds;
            std::printf("Q4_K-shaped %d x %d, M = %2d, one thread: %.3f ms, %.1f GMAC/s\n", N, K, M, s * 1e3,
                        (double)M * N * K / s / 1e9);
        }
    }
    return 0;
}
