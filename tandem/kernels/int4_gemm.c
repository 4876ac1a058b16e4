/* Weight-only int4 matrix multiply for the CPU (AVX2 + FMA + F16C; AVX-512 where built for it),
 * the decode-sized case, and the dequantization the large-batch path hands to BLAS.
 *
 *   y[m, n] = sum_k x[m, k] * s[n, k / 32] * q[n, k]
 *
 * x: float32 [M, K]. Weights in groups of GROUP = 32 consecutive input values per output row,
 * G = ceil(K / 32) groups per row (the last one shorter where K is not a multiple of 32, padded
 * with zeros): q in [-8, 7] stored as q + 8, two per byte, 16 bytes per group (row n, group g at
 * byte (n * G + g) * 16); byte t holds value t in its low nibble and value t + 16 in its high
 * one, so a mask (or an index's low bits) and a shift give values 0-15 and 16-31 in order, no
 * shuffles. s: float16 [N, G], the group's scale (tandem/models/quant_int4.py quantizes).
 *
 * Decode reads every weight once per step: 4.5 bits per weight here against int8's 8. The nibbles
 * become float32 weights in registers and are multiplied in float32, so the only error is the
 * weights' rounding. With AVX-512 each group's 16 levels q * d are computed once (exact) and the
 * widened bytes index them (vpermps reads only an index's low 4 bits, so the low nibbles need no
 * mask and the high ones one shift): the weights themselves. With AVX2 the codes are converted
 * to float, each group's 32 products summed in one chain and the sum scaled into the pair's
 * accumulator. The blocking, the tiles across OpenMP threads and the software prefetch are
 * int8_gemm.c's: register blocks of MR input rows by NR weight rows, every block accumulating
 * each (m, n) the same way, so a row's result does not depend on how many rows share the call
 * (batch invariance). Built and loaded by tandem/kernels/native.py.
 */
#include <math.h>
#include <stdint.h>

#include "simd.h"

#define GROUP 32
#define GROUP_BYTES 16
#define TILE_N 64
/* Per group a block consumes NR * 16 bytes of its NR contiguous weight rows and prefetches this
 * far ahead (rows of 320 bytes are far too short for the hardware prefetcher), and NR scales. */
#define PREFETCH_BYTES 4096
#define PREFETCH_SCALES 256

/* Each instruction set gives vf, VZERO, NR_ONE and NR_WIDE (weight rows per block for one input
 * row and for three or four), finish(a) (an accumulator's lanes summed), dequant_group(p, d, dst)
 * (a group's weights q * d as float32) and GROUP_STEP(MR, NR): group g of the block's NR weight
 * rows into the accumulators a[MR][NR], with the block's x, K, w and sf (the weight rows' scales
 * as float32) in scope. */
#ifdef __AVX512F__
/* 16 lanes, 32 registers: each weight row's group is made first (two vectors), then each input
 * row's 32 values are loaded once for all NR of them. */
typedef __m512 vf;
#define VZERO() _mm512_setzero_ps()
#define NR_ONE 8
#define NR_WIDE 4
static inline void group_weights(const uint8_t *p, float d, vf w[2]) {
    const vf levels = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    vf table = _mm512_mul_ps(levels, _mm512_set1_ps(d));
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    w[0] = _mm512_permutexvar_ps(b, table);
    w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table);
}
#define GROUP_STEP(MR, NR)                                                                          \
    do {                                                                                            \
        vf wv[NR][2];                                                                               \
        for (int j = 0; j < NR; j++) group_weights(w[j] + g * GROUP_BYTES, sf[j][g], wv[j]);        \
        for (int i = 0; i < MR; i++) {                                                              \
            const float *xp = x + i * K + g * GROUP;                                                \
            vf x0 = _mm512_loadu_ps(xp), x1 = _mm512_loadu_ps(xp + 16);                             \
            for (int j = 0; j < NR; j++)                                                            \
                a[i][j] = _mm512_fmadd_ps(x1, wv[j][1], _mm512_fmadd_ps(x0, wv[j][0], a[i][j]));    \
        }                                                                                           \
    } while (0)
static inline float finish(vf a) { return _mm512_reduce_add_ps(a); }
static inline void dequant_group(const uint8_t *p, float d, float *dst) {
    vf w[2];
    group_weights(p, d, w);
    _mm512_storeu_ps(dst, w[0]);
    _mm512_storeu_ps(dst + 16, w[1]);
}
#else
/* 8 lanes, 16 registers: one weight row's group at a time (four vectors of codes). */
typedef __m256 vf;
#define VZERO() _mm256_setzero_ps()
#define NR_ONE 4
#define NR_WIDE 2
static inline void group_codes(const uint8_t *p, vf w[4]) {
    __m128i b = _mm_loadu_si128((const __m128i *)p), mask = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
    __m128i lo = _mm_sub_epi8(_mm_and_si128(b, mask), eight);
    __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(b, 4), mask), eight);
    w[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
    w[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
    w[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
    w[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
}
#define GROUP_STEP(MR, NR)                                                                          \
    do {                                                                                            \
        for (int j = 0; j < NR; j++) {                                                              \
            vf wv[4], d = _mm256_set1_ps(sf[j][g]);                                                 \
            group_codes(w[j] + g * GROUP_BYTES, wv);                                                \
            for (int i = 0; i < MR; i++) {                                                          \
                const float *xp = x + i * K + g * GROUP;                                            \
                vf p = _mm256_mul_ps(_mm256_loadu_ps(xp), wv[0]);                                   \
                for (int v = 1; v < 4; v++) p = _mm256_fmadd_ps(_mm256_loadu_ps(xp + 8 * v), wv[v], p); \
                a[i][j] = _mm256_fmadd_ps(p, d, a[i][j]);                                           \
            }                                                                                       \
        }                                                                                           \
    } while (0)
static inline float finish(vf a) { return hsum8(a); }
static inline void dequant_group(const uint8_t *p, float d, float *dst) {
    vf w[4];
    group_codes(p, w);
    for (int v = 0; v < 4; v++) _mm256_storeu_ps(dst + 8 * v, _mm256_mul_ps(w[v], _mm256_set1_ps(d)));
}
#endif

static inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

/* n float16 values -> float32. */
static inline void halves_to_floats(const uint16_t *src, float *dst, long n) {
    long t = 0;
    for (; t + 8 <= n; t += 8) _mm256_storeu_ps(dst + t, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + t))));
    for (; t < n; t++) dst[t] = half_to_float(src[t]);
}

/* Value t (0 <= t < 32) of a group, as a float. */
static inline float nibble(const uint8_t *group, long t) {
    int b = group[t & 15];
    return (float)(((t < 16 ? b : b >> 4) & 0x0F) - 8);
}

/* MR float32 input rows x (K values each) against NR weight rows (packed w[j], scales s[j]):
 * out[i * NR + j]. The rows' scales are widened to float32 first (sf); full groups in vectors
 * (GROUP_STEP); a last, shorter group (K % 32 values) in scalar code after the horizontal sum:
 * its products summed, then scaled. The two-level macros expand NR_ONE and NR_WIDE before they
 * are pasted into a name. */
#define DEFINE_BLOCK(MR, NR) DEFINE_BLOCK_(MR, NR)
#define DEFINE_BLOCK_(MR, NR)                                                                       \
    static void block_##MR##x##NR(const float *x, long K, long G, const uint8_t *const *w,          \
                                  const uint16_t *const *s, float *out) {                           \
        long full = K / GROUP;                                                                      \
        float sf[NR][G];                                                                            \
        for (int j = 0; j < NR; j++) halves_to_floats(s[j], sf[j], G);                              \
        vf a[MR][NR];                                                                               \
        for (int i = 0; i < MR; i++)                                                                \
            for (int j = 0; j < NR; j++) a[i][j] = VZERO();                                         \
        for (long g = 0; g < full; g++) {                                                           \
            for (int q = 0; q < NR * GROUP_BYTES; q += 64)                                          \
                _mm_prefetch((const char *)(w[0] + PREFETCH_BYTES + g * GROUP_BYTES * NR + q), _MM_HINT_T0); \
            _mm_prefetch((const char *)(s[0] + PREFETCH_SCALES + g * NR), _MM_HINT_T0);             \
            GROUP_STEP(MR, NR);                                                                     \
        }                                                                                           \
        for (int i = 0; i < MR; i++)                                                                \
            for (int j = 0; j < NR; j++) {                                                          \
                float r = finish(a[i][j]);                                                          \
                if (full < G) {                                                                     \
                    const uint8_t *grp = w[j] + full * GROUP_BYTES;                                 \
                    float p = 0.0f;                                                                 \
                    for (long t = 0; t < K - full * GROUP; t++)                                     \
                        p = fmaf(x[i * K + full * GROUP + t], nibble(grp, t), p);                   \
                    r = fmaf(p, sf[j][full], r);                                                    \
                }                                                                                   \
                out[i * NR + j] = r;                                                                \
            }                                                                                       \
    }

DEFINE_BLOCK(1, NR_ONE)
DEFINE_BLOCK(2, 4)
DEFINE_BLOCK(3, NR_WIDE)
DEFINE_BLOCK(4, NR_WIDE)

/* Input rows m .. m+MR against the tile's weight rows n0 .. n1, NR at a time; the last group of
 * rows repeats row n1 - 1 where fewer than NR are left and drops those results. */
#define TILE(MR, NR) TILE_(MR, NR)
#define TILE_(MR, NR)                                                                               \
    for (long n = n0; n < n1; n += NR) {                                                            \
        const uint8_t *wp[NR];                                                                      \
        const uint16_t *sp[NR];                                                                     \
        for (int j = 0; j < NR; j++) {                                                              \
            long r = n + j < n1 ? n + j : n1 - 1;                                                   \
            wp[j] = w + r * G * GROUP_BYTES;                                                        \
            sp[j] = scale + r * G;                                                                  \
        }                                                                                           \
        float out[MR * NR];                                                                         \
        block_##MR##x##NR(x + m * K, K, G, wp, sp, out);                                            \
        for (int i = 0; i < MR; i++)                                                                \
            for (int j = 0; j < NR && n + j < n1; j++) y[(m + i) * N + n + j] = out[i * NR + j];    \
    }

/* Tiles of TILE_N weight rows across the threads; in each, blocks of 4 input rows, then the 1-3
 * rows left. */
void tandem_gemm_i4(const float *x, const uint8_t *w, const uint16_t *scale, float *y, long M, long N, long K) {
    long G = (K + GROUP - 1) / GROUP, tiles = (N + TILE_N - 1) / TILE_N;
#pragma omp parallel for schedule(static)
    for (long t = 0; t < tiles; t++) {
        long n0 = t * TILE_N, n1 = n0 + TILE_N < N ? n0 + TILE_N : N;
        long m = 0;
        for (; m + 4 <= M; m += 4) TILE(4, NR_WIDE);
        switch (M - m) {
            case 3: TILE(3, NR_WIDE); break;
            case 2: TILE(2, 4); break;
            case 1: TILE(1, NR_ONE); break;
        }
    }
}

/* out[n - n0, k] = s[n, k / 32] * q[n, k] for n in [n0, n1), k < K: float32 rows for a BLAS
 * call (exact: a 4-bit integer times a float16 scale fits float32's mantissa). */
void tandem_dequant_i4(const uint8_t *w, const uint16_t *scale, float *out, long n0, long n1, long K) {
    long G = (K + GROUP - 1) / GROUP, full = K / GROUP;
#pragma omp parallel for schedule(static)
    for (long n = n0; n < n1; n++) {
        const uint8_t *src = w + n * G * GROUP_BYTES;
        const uint16_t *sc = scale + n * G;
        float *dst = out + (n - n0) * K;
        for (long g = 0; g < full; g++) dequant_group(src + g * GROUP_BYTES, half_to_float(sc[g]), dst + g * GROUP);
        for (long k = full * GROUP; k < K; k++)
            dst[k] = half_to_float(sc[full]) * nibble(src + full * GROUP_BYTES, k - full * GROUP);
    }
}
