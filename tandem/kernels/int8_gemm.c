/* Weight-only int8 matrix multiply for the CPU (AVX2 + FMA, or AVX-512 with VNNI where the
 * library is built for it: tandem/kernels/native.py VARIANTS), the decode-sized case.
 *
 *   y[m, n] = scale[n] * sum_k x[m, k] * w[n, k]      x: float32 [M, K], w: int8 [N, K]
 *
 * Decode is bound by reading the weights; int8 weights are a quarter of float32's bytes. Each
 * weight is widened to float32 in registers and multiplied in float32, so the only error is the
 * weights' rounding.
 *
 * Register blocks of MR input rows by NR weight rows: 1x4, 2x4 and 3x4 for the few rows of a
 * decode step (bound by reading the weights from memory), 4x2 otherwise (eight independent
 * accumulators, enough to cover the FMA latency once the weights come from cache). Every block
 * accumulates each (m, n) the same way (one accumulator, k in order), so a row's result does not
 * depend on how many rows share the call (batch invariance).
 *
 * Work is split into tiles of TILE_N weight rows across OpenMP threads (the same libgomp torch
 * uses, so one thread pool). Within a tile, each block of input rows runs over all its weight
 * rows while the inputs stay in L1 and the tile's weights in L2. Built and loaded by
 * tandem/kernels/native.py.
 */
#include <stdint.h>

#include "simd.h"
#include "team.h"

#define TILE_N 64
/* The NR weight rows of a block are contiguous; each step over k consumes NR * 8 bytes of them,
 * and the block prefetches as far ahead. Rows of a few hundred bytes are too short for the
 * hardware prefetcher to ramp up on its own: without this, decode reads weights from memory at
 * a third of the bandwidth. */
#define PREFETCH_BYTES 4096

static inline __m256 widen8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

#ifdef __AVX512F__
static inline __m512 widen16(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
#endif

/* The input rows as each kind of block reads them: float32 rows (x), or int8 rows (xq) with one
 * scale per QBLOCK values (xs). */
typedef struct {
    const float *x;
    const int8_t *xq;
    const float *xs;
    long K;
} Inputs;

/* Input rows m0 .. m0+MR against weight rows n0 .. n1 (a tile), NR at a time through
 * BLOCK(in, m0, w[NR], out[MR * NR]); the last group repeats row n1 - 1 where fewer than NR are
 * left and drops those results. A macro, so every block is called directly and inlined. */
#define TILE(BLOCK, MR, NR, in, w, scale, y, m0, n0, n1, N)                                         \
    for (long n = n0; n < n1; n += NR) {                                                            \
        const int8_t *wp[NR];                                                                       \
        for (int j = 0; j < NR; j++) wp[j] = w + (n + j < n1 ? n + j : n1 - 1) * (in)->K;           \
        float out[MR * NR];                                                                         \
        BLOCK(in, m0, wp, out);                                                                     \
        for (int i = 0; i < MR; i++)                                                                \
            for (int j = 0; j < NR && n + j < n1; j++) y[(m0 + i) * N + n + j] = out[i * NR + j] * scale[n + j]; \
    }

/* Tiles of TILE_N weight rows across the threads of a running team (team.h); in each, blocks of
 * 4 input rows (4x2), then the 1-3 rows left (1x4, 2x4, 3x4), with the blocks PREFIX##block_MRxNR.
 * RUN_TILES opens the team. */
#define RUN_TILES(PREFIX, in, w, scale, y, M, N) _Pragma("omp parallel") TEAM_TILES(PREFIX, in, w, scale, y, M, N)
#define TEAM_TILES(PREFIX, in, w, scale, y, M, N)                                                   \
    do {                                                                                            \
        long tiles = (N + TILE_N - 1) / TILE_N;                                                     \
        _Pragma("omp for schedule(static)")                                                         \
        for (long t = 0; t < tiles; t++) {                                                          \
            long n0 = t * TILE_N, n1 = n0 + TILE_N < N ? n0 + TILE_N : N;                           \
            long m = 0;                                                                             \
            for (; m + 4 <= M; m += 4) TILE(PREFIX##block_4x2, 4, 2, in, w, scale, y, m, n0, n1, N); \
            switch (M - m) {                                                                        \
                case 3: TILE(PREFIX##block_3x4, 3, 4, in, w, scale, y, m, n0, n1, N); break;        \
                case 2: TILE(PREFIX##block_2x4, 2, 4, in, w, scale, y, m, n0, n1, N); break;        \
                case 1: TILE(PREFIX##block_1x4, 1, 4, in, w, scale, y, m, n0, n1, N); break;        \
            }                                                                                       \
        }                                                                                           \
    } while (0)

/* MR float32 input rows (from row m0) against NR weight rows w[0..NR): out[i * NR + j]. One
 * function per block shape, with fixed sizes, so the accumulators live in registers. The AVX-512
 * build widens 16 weights per step instead of 8 (its sums are grouped differently, so the two
 * variants agree to float rounding, not bit for bit; each is batch-invariant on its own). */
#ifdef __AVX512F__
#define DEFINE_BLOCK(MR, NR)                                                                        \
    static void block_##MR##x##NR(const Inputs *in, long m0, const int8_t *const *w, float *out) {  \
        long K = in->K;                                                                             \
        const float *x = in->x + m0 * K;                                                            \
        __m512 a[MR][NR];                                                                           \
        for (int i = 0; i < MR; i++)                                                                \
            for (int j = 0; j < NR; j++) a[i][j] = _mm512_setzero_ps();                             \
        long k = 0;                                                                                 \
        for (; k + 16 <= K; k += 16) {                                                              \
            _mm_prefetch((const char *)(w[0] + PREFETCH_BYTES + k * NR), _MM_HINT_T0);              \
            __m512 v[NR];                                                                           \
            for (int j = 0; j < NR; j++) v[j] = widen16(w[j] + k);                                  \
            for (int i = 0; i < MR; i++) {                                                          \
                __m512 xv = _mm512_loadu_ps(x + i * K + k);                                         \
                for (int j = 0; j < NR; j++) a[i][j] = _mm512_fmadd_ps(xv, v[j], a[i][j]);          \
            }                                                                                       \
        }                                                                                           \
        for (int i = 0; i < MR; i++)                                                                \
            for (int j = 0; j < NR; j++) {                                                          \
                float s = _mm512_reduce_add_ps(a[i][j]);                                            \
                for (long t = k; t < K; t++) s += x[i * K + t] * (float)w[j][t];                    \
                out[i * NR + j] = s;                                                                \
            }                                                                                       \
    }
#else
#define DEFINE_BLOCK(MR, NR)                                                                        \
    static void block_##MR##x##NR(const Inputs *in, long m0, const int8_t *const *w, float *out) {  \
        long K = in->K;                                                                             \
        const float *x = in->x + m0 * K;                                                            \
        __m256 a[MR][NR];                                                                           \
        for (int i = 0; i < MR; i++)                                                                \
            for (int j = 0; j < NR; j++) a[i][j] = _mm256_setzero_ps();                             \
        long k = 0;                                                                                 \
        for (; k + 8 <= K; k += 8) {                                                                \
            _mm_prefetch((const char *)(w[0] + PREFETCH_BYTES + k * NR), _MM_HINT_T0);              \
            __m256 v[NR];                                                                           \
            for (int j = 0; j < NR; j++) v[j] = widen8(w[j] + k);                                   \
            for (int i = 0; i < MR; i++) {                                                          \
                __m256 xv = _mm256_loadu_ps(x + i * K + k);                                         \
                for (int j = 0; j < NR; j++) a[i][j] = _mm256_fmadd_ps(xv, v[j], a[i][j]);          \
            }                                                                                       \
        }                                                                                           \
        for (int i = 0; i < MR; i++)                                                                \
            for (int j = 0; j < NR; j++) {                                                          \
                float s = hsum8(a[i][j]);                                                           \
                for (long t = k; t < K; t++) s += x[i * K + t] * (float)w[j][t];                    \
                out[i * NR + j] = s;                                                                \
            }                                                                                       \
    }
#endif

DEFINE_BLOCK(1, 4)
DEFINE_BLOCK(2, 4)
DEFINE_BLOCK(3, 4)
DEFINE_BLOCK(4, 2)

void tandem_gemm_i8(const float *x, const int8_t *w, const float *scale, float *y, long M, long N, long K) {
    Inputs in = {x, NULL, NULL, K};
    RUN_TILES(, &in, w, scale, y, M, N);
}

/* out[n, k] = scale[n0 + n] * w[n0 + n, k] for n in [0, n1 - n0): float32 rows for a BLAS call. */
void tandem_dequant_i8(const int8_t *w, const float *scale, float *out, long n0, long n1, long K) {
#pragma omp parallel for schedule(static)
    for (long n = n0; n < n1; n++) {
        const int8_t *src = w + n * K;
        float *dst = out + (n - n0) * K;
        __m256 s = _mm256_set1_ps(scale[n]);
        long k = 0;
        for (; k + 8 <= K; k += 8) _mm256_storeu_ps(dst + k, _mm256_mul_ps(widen8(src + k), s));
        for (; k < K; k++) dst[k] = scale[n] * (float)src[k];
    }
}

/* --- int8 weights and int8 activations (w8a8) ------------------------------------------------
 *
 *   y[m, n] = scale[n] * sum_b xs[m, b] * sum_{k in block b} xq[m, k] * w[n, k]
 *
 * Each input row is quantized on the fly, symmetric, one scale per block of QBLOCK values
 * (xs[m, b] = max|x[m, block b]| / 127). Products of int8 pairs are summed exactly in integers
 * (maddubs of |w| and x carrying w's sign, then pairs of int16 into int32); one float multiply-add
 * per block applies the activation scale. Twice the multiply-adds of float32 per instruction, so
 * prefill and large decode batches, which are bound by arithmetic, run faster; the cost is the
 * activations' rounding (measured by benchmarks/quant_accuracy.py). Integer sums are exact, so
 * results are independent of batch composition here too.
 */
#define QBLOCK 32

/* x [M, K] float -> xq [M, K] int8 and xs [M, K / QBLOCK] float (K a multiple of QBLOCK); with
 * `sums`, also minus 128 times each block's sum of rounded values, as int32 after xs (the packed
 * VNNI kernel's corrections: team.h, W8A8_BLOCK_SUMS). */
static void quantize_rows_i8(const float *x, int8_t *xq, float *xs, long M, long K, int sums) {
    long nb = K / QBLOCK;
    int32_t *corr = (int32_t *)(xs + M * nb);
#pragma omp for schedule(static)
    for (long mb = 0; mb < M * nb; mb++) {
        const float *src = x + mb * QBLOCK;
        int8_t *dst = xq + mb * QBLOCK;
        __m256 amax = _mm256_setzero_ps(), sign = _mm256_set1_ps(-0.0f);
        for (int t = 0; t < QBLOCK; t += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(src + t)));
        __m128 hi = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        hi = _mm_max_ps(hi, _mm_movehl_ps(hi, hi));
        hi = _mm_max_ss(hi, _mm_movehdup_ps(hi));
        float m = _mm_cvtss_f32(hi);
        float d = m / 127.0f;
        xs[mb] = d;
        __m256 inv = _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
        __m256i total = _mm256_setzero_si256();
        for (int t = 0; t < QBLOCK; t += 8) {
            __m256i q = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(src + t), inv),
                                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            total = _mm256_add_epi32(total, q);
            __m128i p16 = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
            _mm_storel_epi64((__m128i *)(dst + t), _mm_packs_epi16(p16, p16));
        }
        if (sums) {
            __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
            corr[mb] = -128 * _mm_cvtsi128_si32(s4);
        }
    }
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
/* AVX-512 VNNI: two blocks (64 values) per step, their products summed by vpdpbusd, which takes
 * unsigned x signed bytes: the inputs are offset by 128 (x ^ 0x80 = x + 128, one xor per input
 * row and step) and the sum of 128 * w, computed once per weight row and step with the same
 * instruction, starts each accumulator negative, so the integer sums are exact. Lanes 0-7 hold
 * the first block's partial sums and lanes 8-15 the second's, scaled by their own activation
 * scale. */
#define DEFINE_QBLOCK(MR, NR)                                                                       \
    static void qblock_##MR##x##NR(const Inputs *in, long m0, const int8_t *const *w, float *out) { \
        long K = in->K, nb = K / QBLOCK;                                                            \
        const int8_t *xq = in->xq + m0 * K;                                                         \
        const float *xs = in->xs + m0 * nb;                                                         \
        const __m512i offset = _mm512_set1_epi8((char)0x80);                                        \
        __m512 a[MR][NR];                                                                           \
        for (int i = 0; i < MR; i++)                                                                \
            for (int j = 0; j < NR; j++) a[i][j] = _mm512_setzero_ps();                             \
        long b = 0;                                                                                 \
        for (; b + 2 <= nb; b += 2) {                                                               \
            long k = b * QBLOCK;                                                                    \
            for (int p = 0; p < NR * 2 * QBLOCK; p += 64)                                           \
                _mm_prefetch((const char *)(w[0] + PREFETCH_BYTES + k * NR + p), _MM_HINT_T0);      \
            __m512i wv[NR], neg[NR];                                                                \
            for (int j = 0; j < NR; j++) {                                                          \
                wv[j] = _mm512_loadu_si512((const void *)(w[j] + k));                               \
                neg[j] = _mm512_sub_epi32(_mm512_setzero_si512(),                                   \
                                          _mm512_dpbusd_epi32(_mm512_setzero_si512(), offset, wv[j])); \
            }                                                                                       \
            for (int i = 0; i < MR; i++) {                                                          \
                __m512i xu = _mm512_xor_si512(_mm512_loadu_si512((const void *)(xq + i * K + k)), offset); \
                __m512 d = _mm512_insertf32x8(_mm512_set1_ps(xs[i * nb + b]),                       \
                                              _mm256_set1_ps(xs[i * nb + b + 1]), 1);               \
                for (int j = 0; j < NR; j++) {                                                      \
                    __m512i p = _mm512_dpbusd_epi32(neg[j], xu, wv[j]);                             \
                    a[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), d, a[i][j]);                   \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
        float tail[MR * NR];                                                                        \
        for (int t = 0; t < MR * NR; t++) tail[t] = 0.0f;                                           \
        for (; b < nb; b++) { /* an odd last block, 32 values, in 256-bit lanes */                  \
            long k = b * QBLOCK;                                                                    \
            for (int j = 0; j < NR; j++) {                                                          \
                __m256i wj = _mm256_loadu_si256((const __m256i *)(w[j] + k));                       \
                __m256i nj = _mm256_sub_epi32(_mm256_setzero_si256(),                               \
                    _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8((char)0x80), wj));  \
                for (int i = 0; i < MR; i++) {                                                      \
                    __m256i xu = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(xq + i * K + k)), \
                                                  _mm256_set1_epi8((char)0x80));                    \
                    __m256i p = _mm256_dpbusd_epi32(nj, xu, wj);                                    \
                    tail[i * NR + j] += hsum8(_mm256_cvtepi32_ps(p)) * xs[i * nb + b];              \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
        for (int i = 0; i < MR; i++)                                                                \
            for (int j = 0; j < NR; j++) out[i * NR + j] = _mm512_reduce_add_ps(a[i][j]) + tail[i * NR + j]; \
    }
#else
static inline __m256i dot_i8(__m256i wabs, __m256i x_signed_by_w) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, x_signed_by_w), _mm256_set1_epi16(1));
}

#define DEFINE_QBLOCK(MR, NR)                                                                       \
    static void qblock_##MR##x##NR(const Inputs *in, long m0, const int8_t *const *w, float *out) { \
        long K = in->K, nb = K / QBLOCK;                                                            \
        const int8_t *xq = in->xq + m0 * K;                                                         \
        const float *xs = in->xs + m0 * nb;                                                         \
        __m256 a[MR][NR];                                                                           \
        for (int i = 0; i < MR; i++)                                                                \
            for (int j = 0; j < NR; j++) a[i][j] = _mm256_setzero_ps();                             \
        for (long b = 0; b < nb; b++) {                                                             \
            long k = b * QBLOCK;                                                                    \
            for (int p = 0; p < NR * QBLOCK; p += 64)                                               \
                _mm_prefetch((const char *)(w[0] + PREFETCH_BYTES + k * NR + p), _MM_HINT_T0);      \
            __m256i wv[NR], wa[NR];                                                                 \
            for (int j = 0; j < NR; j++) {                                                          \
                wv[j] = _mm256_loadu_si256((const __m256i *)(w[j] + k));                            \
                wa[j] = _mm256_abs_epi8(wv[j]);                                                     \
            }                                                                                       \
            for (int i = 0; i < MR; i++) {                                                          \
                __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + i * K + k));                 \
                __m256 d = _mm256_broadcast_ss(xs + i * nb + b);                                    \
                for (int j = 0; j < NR; j++) {                                                      \
                    __m256i p = dot_i8(wa[j], _mm256_sign_epi8(xv, wv[j]));                         \
                    a[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), d, a[i][j]);                   \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
        for (int i = 0; i < MR; i++)                                                                \
            for (int j = 0; j < NR; j++) out[i * NR + j] = hsum8(a[i][j]);                          \
    }
#endif

DEFINE_QBLOCK(1, 4)
DEFINE_QBLOCK(2, 4)
DEFINE_QBLOCK(3, 4)
DEFINE_QBLOCK(4, 2)

/* K must be a multiple of QBLOCK; xq (M * K bytes) and xs (2 * M * K / QBLOCK floats) are scratch.
 * Where tandem_w8a8_packs(N, K), w is in the packed layout and the product runs there (packed_w8a8.c). */
void tandem_team_gemm_w8a8(const float *x, const int8_t *w, const float *scale, float *y, long M, long N, long K,
                           int8_t *xq, float *xs) {
    int packed = (int)tandem_w8a8_packs(N, K);
    quantize_rows_i8(x, xq, xs, M, K, packed && W8A8_BLOCK_SUMS);
    if (packed) {
        tandem_team_gemm_w8a8_packed(xq, xs, w, scale, y, M, N, K);
        return;
    }
    Inputs in = {NULL, xq, xs, K};
    TEAM_TILES(q, &in, w, scale, y, M, N);
}

void tandem_gemm_w8a8(const float *x, const int8_t *w, const float *scale, float *y, long M, long N, long K,
                      int8_t *xq, float *xs) {
    /* A decode step's few rows are quicker to round here than to hand to the threads. */
    int packed = (int)tandem_w8a8_packs(N, K);
#pragma omp parallel if (M * K >= 16384)
    quantize_rows_i8(x, xq, xs, M, K, packed && W8A8_BLOCK_SUMS);
    if (packed) {
#pragma omp parallel
        tandem_team_gemm_w8a8_packed(xq, xs, w, scale, y, M, N, K);
        return;
    }
    Inputs in = {NULL, xq, xs, K};
    RUN_TILES(q, &in, w, scale, y, M, N);
}

/* Per row, the index of the product's largest value (packed_w8a8.c: tandem_team_w8a8_packed_argmax),
 * for a weight this build takes packed (tandem_w8a8_packs). */
void tandem_gemm_w8a8_argmax(const float *x, const int8_t *w, const float *scale, int64_t *out, long M, long N,
                             long K, int8_t *xq, float *xs, float *scratch) {
#pragma omp parallel
    {
        quantize_rows_i8(x, xq, xs, M, K, W8A8_BLOCK_SUMS);
        tandem_team_w8a8_packed_argmax(xq, xs, w, scale, out, M, N, K, scratch);
    }
}
