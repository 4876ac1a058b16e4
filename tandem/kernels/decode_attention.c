/* Decode attention straight from the paged KV cache (float32, AVX2 + FMA).
 *
 * One query per sequence. For each (sequence, KV head), every query head sharing that KV head
 * (grouped-query attention) is scored against each cached key as the key is read, through the
 * sequence's block table: no keys or values are gathered into a padded copy first, and no mask is
 * built. Two passes over the context: scores (then an exact softmax over them), then the values
 * weighted by the probabilities. Sliding-window layers skip the positions outside the window.
 * Every sequence is computed alone, in the same order whatever else is in the batch.
 *
 * Cache layout: paged_cache.h.
 * Built and loaded by tandem/kernels/native.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "paged_cache.h"
#include "simd.h"

/* q, out: [*, H, D] token rows; rows[s]: the row of sequence s's query (and of its output).
 * tables: [S, max_blocks]; context[s]: keys of sequence s (its query's position + 1).
 * window: keys at positions >= context - window only (0: no window). Returns 0, or -1 if a
 * scratch allocation failed. */
int tandem_decode_attention(const float *q, const float *k_cache, const float *v_cache, const int64_t *tables,
                            long max_blocks, const int64_t *context, const int64_t *rows, float *out, long S, long H,
                            long KVH, long D, long block_size, long window, float scale) {
    long G = H / KVH;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) reduction(| : failed)
    for (long task = 0; task < S * KVH; task++) {
        long s = task / KVH, g = task % KVH;
        long n = context[s];
        long start = window_start(n, window);
        long len = n - start;
        const float *qs = q + (rows[s] * H + g * G) * D;
        float *os = out + (rows[s] * H + g * G) * D;
        float *prob = malloc(sizeof(float) * (size_t)(G * len + 8));
        if (prob == NULL) {
            failed = 1;
            continue;
        }
        const int64_t *table = tables + s * max_blocks;

        /* Scores: prob[h * len + i] = scale * q_h . k_{start + i}. */
        for (long i = 0; i < len; i++) {
            const float *k = k_cache + cache_row(table, start + i, block_size, KVH, g) * D;
            for (long h = 0; h < G; h++) {
                const float *qh = qs + h * D;
                __m256 acc = _mm256_setzero_ps();
                long d = 0;
                for (; d + 8 <= D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qh + d), _mm256_loadu_ps(k + d), acc);
                float dot = hsum8(acc);
                for (; d < D; d++) dot += qh[d] * k[d];
                prob[h * len + i] = dot * scale;
            }
        }

        /* Softmax per query head, in place. */
        for (long h = 0; h < G; h++) softmax_inplace(prob + h * len, len);

        /* Output: o_h = sum_i prob[h, i] * v_{start + i}. */
        memset(os, 0, sizeof(float) * (size_t)(G * D));
        for (long i = 0; i < len; i++) {
            const float *v = v_cache + cache_row(table, start + i, block_size, KVH, g) * D;
            for (long h = 0; h < G; h++) {
                float *oh = os + h * D;
                __m256 w = _mm256_set1_ps(prob[h * len + i]);
                long d = 0;
                for (; d + 8 <= D; d += 8)
                    _mm256_storeu_ps(oh + d, _mm256_fmadd_ps(w, _mm256_loadu_ps(v + d), _mm256_loadu_ps(oh + d)));
                for (; d < D; d++) oh[d] += prob[h * len + i] * v[d];
            }
        }
        free(prob);
    }
    return failed ? -1 : 0;
}
