/* Decode attention straight from the paged KV cache for bfloat16 q, caches and output.
 *
 * The same algorithm as decode_attention.c (see there): one task per (sequence, KV head), its
 * grouped query heads scored against each key as it is read through the block table, an exact
 * softmax, then the values weighted by the probabilities. Everything after the bf16 loads is
 * float32: the query heads are widened once per task, scores, probabilities and the output
 * sums stay float32, and the output is rounded to bf16 once at the end. Every sequence is
 * computed alone, in the same order whatever else is in the batch.
 * Built and loaded by tandem/kernels/native.py.
 */
#include <stdint.h>
#include <stdlib.h>

#include "paged_cache.h"
#include "simd.h"

/* q (bf16) . k (bf16) over D values, q already widened to float32. */
static inline float dot_bf16(const float *q, const uint16_t *k, long D) {
    vf acc = vf_zero();
    long d = 0;
    for (; d + VF_LANES <= D; d += VF_LANES) acc = vf_fmadd(vf_loadu(q + d), vf_load_bf16(k + d), acc);
    float dot = vf_hsum(acc);
    for (; d < D; d++) dot += q[d] * bf16_to_f32(k[d]);
    return dot;
}

/* acc[0 .. D) += p * v[0 .. D), v bf16. */
static inline void axpy_bf16(float *acc, float p, const uint16_t *v, long D) {
    vf w = vf_set1(p);
    long d = 0;
    for (; d + VF_LANES <= D; d += VF_LANES) vf_storeu(acc + d, vf_fmadd(w, vf_load_bf16(v + d), vf_loadu(acc + d)));
    for (; d < D; d++) acc[d] += p * bf16_to_f32(v[d]);
}

/* Arguments as tandem_decode_attention's; q, the caches and out are bf16. Returns 0, or -1 if a
 * scratch allocation failed. */
int tandem_decode_attention_bf16(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                                 const int64_t *tables, long max_blocks, const int64_t *context, const int64_t *rows,
                                 uint16_t *out, long S, long H, long KVH, long D, long block_size, long window,
                                 float scale) {
    long G = H / KVH;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) reduction(| : failed)
    for (long task = 0; task < S * KVH; task++) {
        long s = task / KVH, g = task % KVH;
        long n = context[s];
        long start = window_start(n, window);
        long len = n - start;
        const uint16_t *qs = q + (rows[s] * H + g * G) * D;
        uint16_t *os = out + (rows[s] * H + g * G) * D;
        /* scratch: probabilities [G, len], then the widened query heads [G, D], then their sums. */
        float *prob = malloc(sizeof(float) * (size_t)(G * len + 2 * G * D + 8));
        if (prob == NULL) {
            failed = 1;
            continue;
        }
        float *qf = prob + G * len, *acc = qf + G * D;
        for (long i = 0; i < G * D; i++) {
            qf[i] = bf16_to_f32(qs[i]);
            acc[i] = 0.0f;
        }
        const int64_t *table = tables + s * max_blocks;

        for (long i = 0; i < len; i++) {
            const uint16_t *k = k_cache + cache_row(table, start + i, block_size, KVH, g) * D;
            for (long h = 0; h < G; h++) prob[h * len + i] = dot_bf16(qf + h * D, k, D) * scale;
        }
        for (long h = 0; h < G; h++) softmax_inplace(prob + h * len, len);
        for (long i = 0; i < len; i++) {
            const uint16_t *v = v_cache + cache_row(table, start + i, block_size, KVH, g) * D;
            for (long h = 0; h < G; h++) axpy_bf16(acc + h * D, prob[h * len + i], v, D);
        }
        long i = 0;
        for (; i + VF_LANES <= G * D; i += VF_LANES) vf_store_bf16(os + i, vf_loadu(acc + i));
        for (; i < G * D; i++) os[i] = f32_to_bf16(acc[i]);
        free(prob);
    }
    return failed ? -1 : 0;
}
