/* Weight-only int4 matrix multiply for the CPU (AVX2 + FMA + F16C; AVX-512 where built for it),
 * the decode-sized case, and the dequantization the large-batch path hands to BLAS.
 *
 *   y[m, n] = sum_g s[n, g] * sum_{k in group g} x[m, k] * q[n, k]
 *
 * x: float32 [M, K]. Weights in groups of GROUP = 32 consecutive input values per output row,
 * G = ceil(K / 32) groups per row (the last one shorter where K is not a multiple of 32): q in
 * [-8, 7] stored as q + 8, two per byte, 16 bytes per group (row n, group g at byte
 * (n * G + g) * 16); byte t holds value t in its low nibble and value t + 16 in its high one, so
 * a mask and a shift give values 0-15 and 16-31 in order, no shuffles. s: float16 [N, G], the
 * group's scale (tandem/models/quant_int4.py quantizes).
 *
 * Decode reads every weight once per step: 4.5 bits per weight here against int8's 8. The nibbles
 * are widened to float32 in registers; each group's 32 products are summed in float32 (one
 * vector chain, k in order) and the sum is scaled into the row's accumulator with one multiply-add,
 * so the only error is the weights' rounding. The blocking, the tiles across OpenMP threads and
 * the software prefetch are int8_gemm.c's: register blocks of MR input rows by NR weight rows,
 * every block accumulating each (m, n) the same way, so a row's result does not depend on how
 * many rows share the call (batch invariance). Built and loaded by tandem/kernels/native.py.
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

/* A group's 16 bytes -> its values 0-15 (lo) and 16-31 (hi) as int8 codes in [-8, 7]. */
static inline void split_group(const uint8_t *p, __m128i *lo, __m128i *hi) {
    __m128i b = _mm_loadu_si128((const __m128i *)p), mask = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
    *lo = _mm_sub_epi8(_mm_and_si128(b, mask), eight);
    *hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(b, 4), mask), eight);
}

#ifdef __AVX512F__
/* 16 lanes: a group is two vectors, its low and its high nibbles. */
#define VW 16
typedef __m512 vf;
#define VZERO() _mm512_setzero_ps()
#define VSET1(v) _mm512_set1_ps(v)
#define VLOAD(p) _mm512_loadu_ps(p)
#define VSTORE(p, v) _mm512_storeu_ps(p, v)
#define VMUL(a, b) _mm512_mul_ps(a, b)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VHSUM(v) _mm512_reduce_add_ps(v)
static inline void unpack_group(const uint8_t *p, vf w[2]) {
    __m128i lo, hi;
    split_group(p, &lo, &hi);
    w[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo));
    w[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi));
}
/* 32 registers: four weight rows against up to four input rows. */
#define NR_WIDE 4
#else
#define VW 8
typedef __m256 vf;
#define VZERO() _mm256_setzero_ps()
#define VSET1(v) _mm256_set1_ps(v)
#define VLOAD(p) _mm256_loadu_ps(p)
#define VSTORE(p, v) _mm256_storeu_ps(p, v)
#define VMUL(a, b) _mm256_mul_ps(a, b)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VHSUM(v) hsum8(v)
static inline void unpack_group(const uint8_t *p, vf w[4]) {
    __m128i lo, hi;
    split_group(p, &lo, &hi);
    w[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
    w[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
    w[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
    w[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
}
/* 16 registers: 4 x 2 accumulators, the group's four weight vectors and the partial sum. */
#define NR_WIDE 2
#endif
#define NV (GROUP / VW)

static inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

/* Value t (0 <= t < 32) of a group, as a float. */
static inline float nibble(const uint8_t *group, long t) {
    int b = group[t & 15];
    return (float)(((t < 16 ? b : b >> 4) & 0x0F) - 8);
}

/* MR float32 input rows (from row m0) against NR weight rows (packed w[j], scales s[j]):
 * out[i * NR + j]. Full groups: a vector partial sum per group, scaled into the accumulator; a
 * last, shorter group (K % 32 values) in scalar code after the horizontal sum. The two-level
 * macros expand NR_WIDE before it is pasted into a name. */
#define DEFINE_BLOCK(MR, NR) DEFINE_BLOCK_(MR, NR)
#define DEFINE_BLOCK_(MR, NR)                                                                        \
    static void block_##MR##x##NR(const float *x, long K, long G, const uint8_t *const *w,          \
                                  const uint16_t *const *s, float *out) {                           \
        long full = K / GROUP;                                                                      \
        vf a[MR][NR];                                                                               \
        for (int i = 0; i < MR; i++)                                                                \
            for (int j = 0; j < NR; j++) a[i][j] = VZERO();                                         \
        for (long g = 0; g < full; g++) {                                                           \
            _mm_prefetch((const char *)(w[0] + PREFETCH_BYTES + g * GROUP_BYTES * NR), _MM_HINT_T0); \
            _mm_prefetch((const char *)(s[0] + PREFETCH_SCALES + g * NR), _MM_HINT_T0);             \
            for (int j = 0; j < NR; j++) {                                                          \
                vf wv[NV];                                                                          \
                unpack_group(w[j] + g * GROUP_BYTES, wv);                                           \
                vf d = VSET1(half_to_float(s[j][g]));                                               \
                for (int i = 0; i < MR; i++) {                                                      \
                    const float *xp = x + i * K + g * GROUP;                                        \
                    vf p = VMUL(VLOAD(xp), wv[0]);                                                  \
                    for (int v = 1; v < NV; v++) p = VFMA(VLOAD(xp + v * VW), wv[v], p);            \
                    a[i][j] = VFMA(p, d, a[i][j]);                                                  \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
        for (int i = 0; i < MR; i++)                                                                \
            for (int j = 0; j < NR; j++) {                                                          \
                float r = VHSUM(a[i][j]);                                                           \
                if (full < G) {                                                                     \
                    const uint8_t *grp = w[j] + full * GROUP_BYTES;                                 \
                    float p = 0.0f;                                                                 \
                    for (long t = 0; t < K - full * GROUP; t++)                                     \
                        p = fmaf(x[i * K + full * GROUP + t], nibble(grp, t), p);                   \
                    r = fmaf(p, half_to_float(s[j][full]), r);                                      \
                }                                                                                   \
                out[i * NR + j] = r;                                                                \
            }                                                                                       \
    }

DEFINE_BLOCK(1, 4)
DEFINE_BLOCK(2, 4)
DEFINE_BLOCK(3, NR_WIDE)
DEFINE_BLOCK(4, NR_WIDE)

/* Input rows m0 .. m0+MR against the tile's weight rows n0 .. n1, NR at a time; the last group
 * of rows repeats row n1 - 1 where fewer than NR are left and drops those results. */
#define TILE(MR, NR) TILE_(MR, NR)
#define TILE_(MR, NR)                                                                          \
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
            case 1: TILE(1, 4); break;
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
        for (long g = 0; g < full; g++) {
            vf wv[NV], d = VSET1(half_to_float(sc[g]));
            unpack_group(src + g * GROUP_BYTES, wv);
            for (int v = 0; v < NV; v++) VSTORE(dst + g * GROUP + v * VW, VMUL(wv[v], d));
        }
        for (long k = full * GROUP; k < K; k++)
            dst[k] = half_to_float(sc[full]) * nibble(src + full * GROUP_BYTES, k - full * GROUP);
    }
}
