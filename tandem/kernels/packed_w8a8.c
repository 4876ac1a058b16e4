/* The w8a8 product (int8_gemm.c) on weights packed in groups of 16 rows, where the library is
 * built for AMX int8 tiles or for AVX-512 VNNI (tandem/kernels/native.py VARIANTS: "amx",
 * "avx512").
 *
 *   y[m, n] = scale[n] * sum_b xs[m, b] * sum_{k in block b} xq[m, k] * w[n, k]
 *
 * For a group of 16 weight rows, each block of QBLOCK = 32 values is summed exactly in int32 for
 * every input row, then widened to float and multiplied by the row's activation scale,
 * accumulated over the blocks in order:
 *
 * - AMX: one tile multiply (tdpbssd) sums up to 16 input rows by the 16 weight rows over a block;
 *   the sums are stored and scaled with AVX-512.
 * - VNNI: eight vpdpbusd per input row and block, each taking four consecutive k of the 16
 *   weight rows (one 64-byte row of the packed block) against those four inputs broadcast.
 *
 * Either way a conversion and a float multiply-add cover 512 products of one input row, where
 * the unpacked VNNI kernel (int8_gemm.c) spends them on every 64; at 16 rows the output head
 * (262,144 x 640) ran in 7.1 ms on AMX instead of 22.6 (Xeon with AMX, benchmarks/int8_kernel.py).
 * A single row is bound by reading the weights, which each thread streams from memory in order.
 *
 * Each (m, n) sums its blocks in the same order whatever the row count, and the block sums are
 * exact, so a row's result never depends on the rows beside it (batch invariance), and the two
 * builds give the same bits. They differ from the unpacked kernel's in float rounding only: that
 * kernel sums partial products per lane before its final reduction.
 *
 * The weights are packed once (tandem.kernels.native.Kernels.w8a8_weight): for each group of 16
 * weight rows and each block, 8 rows of 64 bytes holding four consecutive k of each of the 16
 * weight rows,
 *
 *   wp[t][b][k4][4 n + r] = w[16 t + n][32 b + 4 k4 + r].
 *
 * vpdpbusd multiplies unsigned by signed bytes, so the VNNI build packs the weights plus 128
 * (tandem_w8a8_weight_xor) and starts each row's block sums at minus 128 times the sum of its
 * rounded inputs in the block, which int8_gemm.c's rounding writes beside the scales
 * (W8A8_BLOCK_SUMS in team.h); the inputs stay signed and are read four at a time as the
 * broadcast operand of vpdpbusd itself. For AMX the OS must have granted the process the
 * tile state (tandem.kernels.cpu_features asks, as torch does, before the variant loads).
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "team.h"

#define QBLOCK 32
#define ROWS 16      /* input rows per tile */
#define GROUP 16     /* weight rows per tile column group */
#define BLOCK_BYTES 512
/* The packed weights are read ahead by this many bytes: without it a single row (decode at
 * batch 1) read them at about three quarters of the rate the VNNI kernel reaches. */
#define PREFETCH_BYTES 8192

/* The scratch of tandem_team_w8a8_packed_argmax, in floats: per thread a best value and index per
 * row and lane, then per thread a best per row. */
long tandem_w8a8_argmax_scratch(long M, long threads) { return threads * M * (2 * GROUP + 3); }

#if defined(__AMX_INT8__) || defined(__AVX512VNNI__)
long tandem_w8a8_packs(long N, long K) { return N % GROUP == 0 && K % QBLOCK == 0; }

long tandem_w8a8_weight_xor(void) { return W8A8_BLOCK_SUMS ? 0x80 : 0; }

#ifdef __AMX_INT8__
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) TileConfig;

/* Tiles 0-1: input rows (rows x 32 bytes), 2-3: weights (8 x 64 bytes), 4-5: sums (rows x 16 int32). */
static void configure(int rows) {
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 2; t++) {
        c.rows[t] = (uint8_t)rows;
        c.colsb[t] = QBLOCK;
        c.rows[t + 2] = QBLOCK / 4;
        c.colsb[t + 2] = 64;
        c.rows[t + 4] = (uint8_t)rows;
        c.colsb[t + 4] = 64;
    }
    /* not _tile_loadconfig: GCC 12's form tells the compiler it reads 8 bytes, and the stores
     * filling the rest of the 64 were moved past it (ldtilecfg then faulted on a half-written
     * configuration) */
    __asm__ volatile("ldtilecfg %0" ::"m"(c));
}

/* The input rows of the tile from row m0 (at most ROWS), the tiles configured for that count
 * unless they already are (*configured: the count they were last configured for, 0 for none). */
static inline int tile_rows(long M, long m0, int *configured) {
    int rows = M - m0 < ROWS ? (int)(M - m0) : ROWS;
    if (rows != *configured) {
        configure(rows);
        *configured = rows;
    }
    return rows;
}

#define RELEASE_TILES(configured) \
    if (configured) _tile_release();

/* acc[i] += xs[i, b] * sums[i] for the tile's rows. */
#define SCALE_ADD(sums, b)                                                                          \
    for (int i = 0; i < ROWS; i++)                                                                  \
        if (i < rows)                                                                               \
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums[i])),               \
                                     _mm512_set1_ps(xs[(m0 + i) * nb + (b)]), acc[i]);

/* The product's rows m0 .. m0 + rows against the weight group wt, before the weights' scales:
 * acc[i] holds row m0 + i's 16 sums. The tiles must be configured for `rows`. (xc: the VNNI
 * build's corrections, unused here.) */
static inline __attribute__((always_inline)) void group_sums(const int8_t *xq, const float *xs, const int32_t *xc,
                                                            const int8_t *wt, long m0, int rows, long K,
                                                            __m512 *acc) {
    (void)xc;
    long nb = K / QBLOCK;
    int32_t sums[2][ROWS][16] __attribute__((aligned(64)));
    const int8_t *xa = xq + m0 * K;
    for (int i = 0; i < ROWS; i++) acc[i] = _mm512_setzero_ps();
    long b = 0;
    for (; b + 2 <= nb; b += 2) {
        if (m0 == 0) /* the first row tile streams the weights; the others find them in cache */
            for (int p = 0; p < 2 * BLOCK_BYTES; p += 64)
                _mm_prefetch((const char *)(wt + b * BLOCK_BYTES + PREFETCH_BYTES + p), _MM_HINT_T0);
        _tile_zero(4);
        _tile_zero(5);
        _tile_loadd(0, xa + b * QBLOCK, K);
        _tile_loadd(2, wt + b * BLOCK_BYTES, 64);
        _tile_dpbssd(4, 0, 2);
        _tile_loadd(1, xa + (b + 1) * QBLOCK, K);
        _tile_loadd(3, wt + (b + 1) * BLOCK_BYTES, 64);
        _tile_dpbssd(5, 1, 3);
        _tile_stored(4, sums[0], 64);
        SCALE_ADD(sums[0], b)
        _tile_stored(5, sums[1], 64);
        SCALE_ADD(sums[1], b + 1)
    }
    if (b < nb) { /* an odd last block */
        _tile_zero(4);
        _tile_loadd(0, xa + b * QBLOCK, K);
        _tile_loadd(2, wt + b * BLOCK_BYTES, 64);
        _tile_dpbssd(4, 0, 2);
        _tile_stored(4, sums[0], 64);
        SCALE_ADD(sums[0], b)
    }
}

#else /* AVX-512 VNNI */

/* The row count of the tile of input rows from m0 (at most ROWS); no state to set up. */
static inline int tile_rows(long M, long m0, int *configured) {
    (void)configured;
    return M - m0 < ROWS ? (int)(M - m0) : ROWS;
}

#define RELEASE_TILES(configured) (void)(configured);

/* As the AMX group_sums: acc[i] holds row m0 + i's 16 sums before the weights' scales. The
 * weights hold w + 128; xc[m * nb + b] is minus 128 times row m's rounded inputs' sum over block
 * b, so each block's integer sum starts there and comes out exact. Per block the eight 64-byte
 * rows of weights stay in registers for every input row, whose inputs each vpdpbusd broadcasts
 * four at a time from memory; two chains of four, so a single row does not wait on one of eight. */
static inline __attribute__((always_inline)) void group_sums(const int8_t *xq, const float *xs, const int32_t *xc,
                                                            const int8_t *wt, long m0, int rows, long K,
                                                            __m512 *acc) {
    long nb = K / QBLOCK;
    const int8_t *xa = xq + m0 * K;
    for (int i = 0; i < ROWS; i++) acc[i] = _mm512_setzero_ps();
    for (long b = 0; b < nb; b++) {
        const int8_t *wb = wt + b * BLOCK_BYTES;
        /* the first row tile streams the weights (the others find them in cache), prefetched into
         * L2 only: on a Zen 4 a single row read the head from memory slower with T0, which also
         * evicts L1 lines the rows still use */
        if (m0 == 0)
            for (int p = 0; p < BLOCK_BYTES; p += 64)
                _mm_prefetch((const char *)(wb + PREFETCH_BYTES + p), _MM_HINT_T1);
        __m512i w[QBLOCK / 4];
        for (int k4 = 0; k4 < QBLOCK / 4; k4++) w[k4] = _mm512_loadu_si512((const void *)(wb + 64 * k4));
        const int8_t *xb = xa + b * QBLOCK;
        for (int i = 0; i < ROWS; i++)
            if (i < rows) {
                __m512i s0 = _mm512_set1_epi32(xc[(m0 + i) * nb + b]), s1 = _mm512_setzero_si512();
                for (int k4 = 0; k4 < QBLOCK / 4; k4 += 2) {
                    const int8_t *x4 = xb + i * K + 4 * k4;
                    s0 = _mm512_dpbusd_epi32(s0, w[k4], _mm512_broadcastd_epi32(_mm_loadu_si32(x4)));
                    s1 = _mm512_dpbusd_epi32(s1, w[k4 + 1], _mm512_broadcastd_epi32(_mm_loadu_si32(x4 + 4)));
                }
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)),
                                         _mm512_set1_ps(xs[(m0 + i) * nb + b]), acc[i]);
            }
    }
}
#endif

void tandem_team_gemm_w8a8_packed(const int8_t *xq, const float *xs, const int8_t *wp, const float *scale, float *y,
                                  long M, long N, long K) {
    long nb = K / QBLOCK, groups = N / GROUP;
    const int32_t *xc = (const int32_t *)(xs + M * nb);
    int configured = 0;
#pragma omp for schedule(static)
    for (long t = 0; t < groups; t++) {
        __m512 s = _mm512_loadu_ps(scale + t * GROUP);
        for (long m0 = 0; m0 < M; m0 += ROWS) { /* every tile of input rows against this group */
            int rows = tile_rows(M, m0, &configured);
            __m512 acc[ROWS];
            group_sums(xq, xs, xc, wp + t * nb * BLOCK_BYTES, m0, rows, K, acc);
            for (int i = 0; i < rows; i++) _mm512_storeu_ps(y + (m0 + i) * N + t * GROUP, _mm512_mul_ps(acc[i], s));
        }
    }
    RELEASE_TILES(configured)
}

/* (v, i) replaces the best so far (*bm, *ba) if it is a candidate (i >= 0) and larger, or equal
 * with a smaller index: the first index of the maximum, whatever order the candidates come in. */
static inline void keep_better(float v, long i, float *bm, long *ba) {
    if (i >= 0 && (*ba < 0 || v > *bm || (v == *bm && i < *ba))) {
        *bm = v;
        *ba = i;
    }
}

/* Per row, the index of the largest value of the product (the first one on ties; NaNs never
 * chosen; 0 when nothing compares), as tandem_argmax_rows would find it in the product's output,
 * whose values these are, computed the same way: greedy decoding's output head without writing
 * and reading back a [M, N] table of logits (262,144 floats a row for Gemma 3). Each thread keeps
 * a running best per row and lane over its groups, then its best per row; one thread merges them
 * in index order. scratch: tandem_w8a8_argmax_scratch(M, threads) floats, 64-byte aligned. */
void tandem_team_w8a8_packed_argmax(const int8_t *xq, const float *xs, const int8_t *wp, const float *scale,
                                    int64_t *out, long M, long N, long K, float *scratch) {
    long nb = K / QBLOCK, groups = N / GROUP, threads = omp_get_num_threads(), me = omp_get_thread_num();
    const int32_t *xc = (const int32_t *)(xs + M * nb);
    float *lane_v = scratch + me * M * 2 * GROUP;
    int32_t *lane_i = (int32_t *)(lane_v + M * GROUP);
    int64_t *row_i = (int64_t *)(scratch + threads * M * 2 * GROUP); /* then threads * M floats */
    float *row_v = (float *)(row_i + threads * M);
    for (long i = 0; i < M * GROUP; i++) {
        lane_v[i] = -INFINITY;
        lane_i[i] = -1;
    }
    int configured = 0;
#pragma omp for schedule(static) nowait
    for (long t = 0; t < groups; t++) {
        __m512 s = _mm512_loadu_ps(scale + t * GROUP);
        __m512i idx = _mm512_add_epi32(_mm512_set1_epi32((int)(t * GROUP)),
                                       _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
        for (long m0 = 0; m0 < M; m0 += ROWS) {
            int rows = tile_rows(M, m0, &configured);
            __m512 acc[ROWS];
            group_sums(xq, xs, xc, wp + t * nb * BLOCK_BYTES, m0, rows, K, acc);
            for (int i = 0; i < rows; i++) {
                float *bv = lane_v + (m0 + i) * GROUP;
                int32_t *bi = lane_i + (m0 + i) * GROUP;
                __m512 v = _mm512_mul_ps(acc[i], s), best = _mm512_loadu_ps(bv);
                __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ); /* strict: the first index stays */
                _mm512_storeu_ps(bv, _mm512_mask_blend_ps(gt, best, v));
                _mm512_storeu_si512(bi, _mm512_mask_blend_epi32(gt, _mm512_loadu_si512(bi), idx));
            }
        }
    }
    RELEASE_TILES(configured)
    for (long r = 0; r < M; r++) { /* this thread's best per row over its lanes */
        float bm = -INFINITY;
        long ba = -1;
        for (int l = 0; l < GROUP; l++) keep_better(lane_v[r * GROUP + l], lane_i[r * GROUP + l], &bm, &ba);
        row_v[me * M + r] = bm;
        row_i[me * M + r] = ba;
    }
#pragma omp barrier
#pragma omp for schedule(static)
    for (long r = 0; r < M; r++) {
        float bm = -INFINITY;
        long ba = -1;
        for (long th = 0; th < threads; th++) keep_better(row_v[th * M + r], row_i[th * M + r], &bm, &ba);
        out[r] = ba < 0 ? 0 : ba;
    }
}
#else
long tandem_w8a8_packs(long N, long K) {
    (void)N;
    (void)K;
    return 0; /* this build has neither AMX nor VNNI: the weights stay [N, K] for the AVX2 kernel */
}

long tandem_w8a8_weight_xor(void) { return 0; }

/* never called where nothing packs (above) */
void tandem_team_gemm_w8a8_packed(const int8_t *xq, const float *xs, const int8_t *wp, const float *scale, float *y,
                                  long M, long N, long K) {
    (void)xq, (void)xs, (void)wp, (void)scale, (void)y, (void)M, (void)N, (void)K;
}

void tandem_team_w8a8_packed_argmax(const int8_t *xq, const float *xs, const int8_t *wp, const float *scale,
                                    int64_t *out, long M, long N, long K, float *scratch) {
    (void)xq, (void)xs, (void)wp, (void)scale, (void)out, (void)M, (void)N, (void)K, (void)scratch;
}
#endif
