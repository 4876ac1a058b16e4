/* Decode attention straight from the paged KV cache, float32 or bfloat16 (one source, two
 * entry points: tandem_decode_attention and tandem_decode_attention_bf16).
 *
 * One query per sequence. Each sequence's context (the positions its query attends to; a
 * sliding-window layer skips those outside the window) is cut into parts of DECODE_PART
 * positions, counted from its first attended position. One task per (part, KV head): every
 * query head sharing that KV head (grouped-query attention) is scored against each of the
 * part's keys as the key is read through the sequence's block table (no gathered copy, no
 * mask), then the part's values are summed, weighted by exp(score - the part's maximum). A
 * second pass merges each sequence's parts in position order, rescaled to their common maximum
 * (the split softmax of flash decoding). Splitting by position keeps both cores busy when one
 * sequence with a single KV head is all there is (batch 1 on Gemma 3 270M was one task).
 *
 * A sequence's parts depend only on its own context, and they are merged in one fixed order,
 * so its result does not depend on the other sequences in the batch (batch invariance).
 * Everything after the loads is float32: bfloat16 queries are widened once per task, keys and
 * values as they are read, and the output is rounded to bfloat16 once at the end.
 *
 * Cache layout: paged_cache.h. Built and loaded by tandem/kernels/native.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "paged_cache.h"
#include "simd.h"
#include "team.h"

/* The element type's loads and stores, all through float32. */
static inline float dot_f32(const float *q, const float *k, long D) {
    vf acc = vf_zero();
    long d = 0;
    for (; d + VF_LANES <= D; d += VF_LANES) acc = vf_fmadd(vf_loadu(q + d), vf_loadu(k + d), acc);
    float dot = vf_hsum(acc);
    for (; d < D; d++) dot += q[d] * k[d];
    return dot;
}

static inline float dot_bf16(const float *q, const uint16_t *k, long D) {
    vf acc = vf_zero();
    long d = 0;
    for (; d + VF_LANES <= D; d += VF_LANES) acc = vf_fmadd(vf_loadu(q + d), vf_load_bf16(k + d), acc);
    float dot = vf_hsum(acc);
    for (; d < D; d++) dot += q[d] * bf16_to_f32(k[d]);
    return dot;
}

/* acc[0 .. D) += p * v[0 .. D) */
static inline void axpy_f32(float *acc, float p, const float *v, long D) {
    vf w = vf_set1(p);
    long d = 0;
    for (; d + VF_LANES <= D; d += VF_LANES) vf_storeu(acc + d, vf_fmadd(w, vf_loadu(v + d), vf_loadu(acc + d)));
    for (; d < D; d++) acc[d] += p * v[d];
}

static inline void axpy_bf16(float *acc, float p, const uint16_t *v, long D) {
    vf w = vf_set1(p);
    long d = 0;
    for (; d + VF_LANES <= D; d += VF_LANES) vf_storeu(acc + d, vf_fmadd(w, vf_load_bf16(v + d), vf_loadu(acc + d)));
    for (; d < D; d++) acc[d] += p * bf16_to_f32(v[d]);
}

static inline void widen_f32(float *dst, const float *src, long n) { memcpy(dst, src, sizeof(float) * (size_t)n); }

static inline void widen_bf16(float *dst, const uint16_t *src, long n) {
    for (long i = 0; i < n; i++) dst[i] = bf16_to_f32(src[i]);
}

static inline void store_f32(float *dst, const float *src, long n) { memcpy(dst, src, sizeof(float) * (size_t)n); }

static inline void store_bf16(uint16_t *dst, const float *src, long n) {
    long i = 0;
    for (; i + VF_LANES <= n; i += VF_LANES) vf_store_bf16(dst + i, vf_loadu(src + i));
    for (; i < n; i++) dst[i] = f32_to_bf16(src[i]);
}

/* p[0 .. n) replaced by exp(p - max p); returns the maximum, the sum in *sum. */
static inline float exp_shifted(float *p, long n, float *sum) {
    float m = -INFINITY;
    for (long i = 0; i < n; i++) m = p[i] > m ? p[i] : m;
    __m256 vm = _mm256_set1_ps(m), vsum = _mm256_setzero_ps();
    long i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + i), vm));
        _mm256_storeu_ps(p + i, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    float s = hsum8(vsum);
    for (; i < n; i++) {
        p[i] = expf(p[i] - m);
        s += p[i];
    }
    *sum = s;
    return m;
}

/* A part's keys and values for G query heads at once, with G a compile-time constant (1, 2, 4
 * or 8; other group sizes take the loops in the task itself). The same arithmetic as one head
 * at a time, in the same order for every (head, element): each score is one accumulator over d
 * in VF_LANES steps, then its horizontal sum; each output element sums p * v over the part's
 * positions in order. Only the loops are arranged differently: a key is loaded once for all G
 * heads, and the weighted values accumulate in registers over every position, a slice of
 * CHUNK = VF_ACC / G vectors at a time, instead of being loaded and stored back to the record
 * for each position and head (that had made the values' pass about two thirds of decode
 * attention at batch 16). So the results are the same bits as the loops they replace. */
#ifdef __AVX512F__
#define VF_ACC 16 /* accumulators for the values' pass: half the vector registers */
#else
#define VF_ACC 8
#endif

/* Rows this far ahead are prefetched: a sequence's keys lie in blocks of a few rows scattered
 * over the cache, too short for the hardware prefetcher to follow. */
#define ROWS_AHEAD 2

static inline void prefetch_row(const void *p, long bytes, int l2) {
    for (long b = 0; b < bytes; b += 64) {
        if (l2) _mm_prefetch((const char *)p + b, _MM_HINT_T1);
        else _mm_prefetch((const char *)p + b, _MM_HINT_T0);
    }
}

#define DEFINE_GROUP(G, T, SUFFIX, LOADV)                                                           \
    static void scores_##SUFFIX##_g##G(const float *qf, const T *k_cache, const long *row, long len, long D, \
                                       float scale, float *prob) {                                  \
        for (long i = 0; i < len; i++) {                                                            \
            const T *k = k_cache + row[i] * D;                                                      \
            if (i + ROWS_AHEAD < len) prefetch_row(k_cache + row[i + ROWS_AHEAD] * D, D * (long)sizeof(T), 0); \
            vf a[G];                                                                                \
            for (int h = 0; h < G; h++) a[h] = vf_zero();                                           \
            long d = 0;                                                                             \
            for (; d + VF_LANES <= D; d += VF_LANES) {                                              \
                vf kv = LOADV(k + d);                                                               \
                for (int h = 0; h < G; h++) a[h] = vf_fmadd(vf_loadu(qf + h * D + d), kv, a[h]);    \
            }                                                                                       \
            for (int h = 0; h < G; h++) {                                                           \
                float dot = vf_hsum(a[h]);                                                          \
                for (long t = d; t < D; t++) dot += qf[h * D + t] * SCALAR_##SUFFIX(k[t]);         \
                prob[h * DECODE_PART + i] = dot * scale;                                            \
            }                                                                                       \
        }                                                                                           \
    }                                                                                               \
    static void values_##SUFFIX##_g##G(const T *v_cache, const long *row, long len, long D, const float *prob, \
                                       float *rec) {                                                \
        enum { CHUNK = VF_ACC / G };                                                                \
        long d0 = 0;                                                                                \
        for (; d0 + CHUNK * VF_LANES <= D; d0 += CHUNK * VF_LANES) {                                \
            vf a[G][CHUNK];                                                                         \
            for (int h = 0; h < G; h++)                                                             \
                for (int c = 0; c < CHUNK; c++) a[h][c] = vf_zero();                                \
            for (long i = 0; i < len; i++) {                                                        \
                const T *v = v_cache + row[i] * D + d0;                                             \
                if (d0 == 0 && i + ROWS_AHEAD < len) /* the whole row, for this slice and the next */ \
                    prefetch_row(v_cache + row[i + ROWS_AHEAD] * D, D * (long)sizeof(T), 1);        \
                vf vv[CHUNK];                                                                       \
                for (int c = 0; c < CHUNK; c++) vv[c] = LOADV(v + c * VF_LANES);                    \
                for (int h = 0; h < G; h++) {                                                       \
                    vf w = vf_set1(prob[h * DECODE_PART + i]);                                      \
                    for (int c = 0; c < CHUNK; c++) a[h][c] = vf_fmadd(w, vv[c], a[h][c]);          \
                }                                                                                   \
            }                                                                                       \
            for (int h = 0; h < G; h++)                                                             \
                for (int c = 0; c < CHUNK; c++) vf_storeu(rec + h * D + d0 + c * VF_LANES, a[h][c]); \
        }                                                                                           \
        if (d0 < D) { /* a head size that is not whole slices: the rest element-wise, in order */   \
            for (int h = 0; h < G; h++) memset(rec + h * D + d0, 0, sizeof(float) * (size_t)(D - d0)); \
            for (long i = 0; i < len; i++)                                                          \
                for (int h = 0; h < G; h++)                                                         \
                    axpy_##SUFFIX(rec + h * D + d0, prob[h * DECODE_PART + i], v_cache + row[i] * D + d0, D - d0); \
        }                                                                                           \
    }

#define SCALAR_f32(x) (x)
#define SCALAR_bf16(x) bf16_to_f32(x)
DEFINE_GROUP(1, float, f32, vf_loadu)
DEFINE_GROUP(2, float, f32, vf_loadu)
DEFINE_GROUP(4, float, f32, vf_loadu)
DEFINE_GROUP(8, float, f32, vf_loadu)
DEFINE_GROUP(1, uint16_t, bf16, vf_load_bf16)
DEFINE_GROUP(2, uint16_t, bf16, vf_load_bf16)
DEFINE_GROUP(4, uint16_t, bf16, vf_load_bf16)
DEFINE_GROUP(8, uint16_t, bf16, vf_load_bf16)

/* The part's scores and weighted values through the G-head forms above; 0 for a group size
 * they do not cover. */
#define DEFINE_GROUPED(T, SUFFIX)                                                                   \
    static int grouped_##SUFFIX(long G, const float *qf, const T *k_cache, const T *v_cache, const long *row, \
                                long len, long D, float scale, float *prob, float *rec) {           \
        switch (G) {                                                                                \
            case 1: scores_##SUFFIX##_g1(qf, k_cache, row, len, D, scale, prob); break;             \
            case 2: scores_##SUFFIX##_g2(qf, k_cache, row, len, D, scale, prob); break;             \
            case 4: scores_##SUFFIX##_g4(qf, k_cache, row, len, D, scale, prob); break;             \
            case 8: scores_##SUFFIX##_g8(qf, k_cache, row, len, D, scale, prob); break;             \
            default: return 0;                                                                      \
        }                                                                                           \
        float *m = rec + G * D;                                                                     \
        for (long h = 0; h < G; h++) m[h] = exp_shifted(prob + h * DECODE_PART, len, m + G + h);   \
        switch (G) {                                                                                \
            case 1: values_##SUFFIX##_g1(v_cache, row, len, D, prob, rec); break;                   \
            case 2: values_##SUFFIX##_g2(v_cache, row, len, D, prob, rec); break;                   \
            case 4: values_##SUFFIX##_g4(v_cache, row, len, D, prob, rec); break;                   \
            default: values_##SUFFIX##_g8(v_cache, row, len, D, prob, rec); break;                  \
        }                                                                                           \
        return 1;                                                                                   \
    }
DEFINE_GROUPED(float, f32)
DEFINE_GROUPED(uint16_t, bf16)

/* The sequence that part p belongs to: first[s] <= p < first[s + 1]. */
static inline long part_sequence(const long *first, long S, long p) {
    long lo = 0, hi = S - 1;
    while (lo < hi) {
        long mid = (lo + hi + 1) / 2;
        if (first[mid] <= p) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

/* Merge the parts [p0, p1) of one (sequence, KV head) into out_f [G, D] (float32). Each part's
 * record holds its unnormalized sums o [G, D], then its maxima m [G] and exp sums l [G]. */
static void merge_parts(const float *partial, long p0, long p1, long KVH, long g, long G, long D, float *out_f) {
    long stride = G * (D + 2);
    if (p1 == p0) { /* no keys: nothing to attend to */
        memset(out_f, 0, sizeof(float) * (size_t)(G * D));
        return;
    }
    for (long h = 0; h < G; h++) {
        float M = -INFINITY;
        for (long p = p0; p < p1; p++) {
            float m = partial[(p * KVH + g) * stride + G * D + h];
            M = m > M ? m : M;
        }
        float *oh = out_f + h * D, L = 0.0f;
        memset(oh, 0, sizeof(float) * (size_t)D);
        for (long p = p0; p < p1; p++) {
            const float *rec = partial + (p * KVH + g) * stride;
            float w = expf(rec[G * D + h] - M);
            L += w * rec[G * D + G + h];
            axpy_f32(oh, w, rec + h * D, D);
        }
        float inv = 1.0f / L;
        for (long d = 0; d < D; d++) oh[d] *= inv;
    }
}

/* The parts of each sequence's context: first[s] is sequence s's first part (first[S]: the
 * total, also returned; first may be NULL). */
static long count_parts(const int64_t *context, long S, long window, long *first) {
    long total = 0;
    for (long s = 0; s < S; s++) {
        if (first != NULL) first[s] = total;
        long len = context[s] - window_start(context[s], window);
        total += (len + DECODE_PART - 1) / DECODE_PART;
    }
    if (first != NULL) first[S] = total;
    return total;
}

long tandem_decode_attention_parts(const int64_t *context, long S, long window) {
    return count_parts(context, S, window, NULL);
}

/* Per thread: scores [G, DECODE_PART], then the widened query heads [G, D] (the merge reuses
 * the start for one merged output [G, D]). */
long tandem_decode_attention_prob_floats(long G, long D) { return G * (DECODE_PART + D) + 8; }

/* q, out: [*, H, D] token rows; rows[s]: the row of sequence s's query (and of its output).
 * tables: [S, max_blocks]; context[s]: keys of sequence s (its query's position + 1).
 * window: keys at positions >= context - window only (0: no window). Scratch: team.h. The team
 * form of NAME (called by every thread of a running team); NAME opens the team and allocates
 * the scratch, and returns 0, or -1 if an allocation failed. */
#define DEFINE_DECODE_ATTENTION(NAME, T, SUFFIX)                                                    \
    void NAME##_team(const T *q, const T *k_cache, const T *v_cache, const int64_t *tables, long max_blocks, \
                     const int64_t *context, const int64_t *rows, T *out, long S, long H, long KVH, long D, \
                     long block_size, long window, float scale, long *first, float *partial, float *prob_base, \
                     long prob_stride) {                                                            \
        long G = H / KVH, stride = G * (D + 2);                                                     \
        _Pragma("omp single")                                                                       \
        count_parts(context, S, window, first);                                                     \
        long P = first[S];                                                                          \
        float *prob = prob_base + omp_get_thread_num() * prob_stride;                               \
        _Pragma("omp for schedule(dynamic, 1)")                                                     \
        for (long task = 0; task < P * KVH; task++) {                                               \
            long p = task / KVH, g = task % KVH;                                                    \
            long s = part_sequence(first, S, p);                                                    \
            long start = window_start(context[s], window) + (p - first[s]) * DECODE_PART;           \
            long len = context[s] - start < DECODE_PART ? context[s] - start : DECODE_PART;         \
            const int64_t *table = tables + s * max_blocks;                                         \
            float *qf = prob + G * DECODE_PART, *rec = partial + task * stride;                     \
            widen_##SUFFIX(qf, q + (rows[s] * H + g * G) * D, G * D);                               \
            long row[DECODE_PART];                                                                  \
            for (long i = 0; i < len; i++) row[i] = cache_row(table, start + i, block_size, KVH, g); \
            if (grouped_##SUFFIX(G, qf, k_cache, v_cache, row, len, D, scale, prob, rec)) continue; \
            for (long i = 0; i < len; i++) {                                                        \
                const T *k = k_cache + row[i] * D;                                                  \
                for (long h = 0; h < G; h++) prob[h * DECODE_PART + i] = dot_##SUFFIX(qf + h * D, k, D) * scale; \
            }                                                                                       \
            for (long h = 0; h < G; h++)                                                            \
                rec[G * D + h] = exp_shifted(prob + h * DECODE_PART, len, rec + G * D + G + h);     \
            memset(rec, 0, sizeof(float) * (size_t)(G * D));                                       \
            for (long i = 0; i < len; i++) {                                                        \
                const T *v = v_cache + row[i] * D;                                                  \
                for (long h = 0; h < G; h++) axpy_##SUFFIX(rec + h * D, prob[h * DECODE_PART + i], v, D); \
            }                                                                                       \
        }                                                                                           \
        /* the implicit barrier: every part is done */                                              \
        _Pragma("omp for schedule(static)")                                                         \
        for (long task = 0; task < S * KVH; task++) {                                               \
            long s = task / KVH, g = task % KVH;                                                    \
            float *of = prob; /* G * D floats: the merged output in float32 */                     \
            merge_parts(partial, first[s], first[s + 1], KVH, g, G, D, of);                         \
            store_##SUFFIX(out + (rows[s] * H + g * G) * D, of, G * D);                             \
        }                                                                                           \
    }                                                                                               \
                                                                                                    \
    int NAME(const T *q, const T *k_cache, const T *v_cache, const int64_t *tables, long max_blocks, \
             const int64_t *context, const int64_t *rows, T *out, long S, long H, long KVH, long D,  \
             long block_size, long window, float scale) {                                          \
        long G = H / KVH, P = count_parts(context, S, window, NULL);                                \
        long threads = omp_get_max_threads(), prob_stride = tandem_decode_attention_prob_floats(G, D); \
        long *first = malloc(sizeof(long) * (size_t)(S + 1));                                       \
        float *partial = malloc(sizeof(float) * (size_t)(P * KVH * G * (D + 2) + 1));               \
        float *prob = malloc(sizeof(float) * (size_t)(threads * prob_stride));                      \
        int failed = first == NULL || partial == NULL || prob == NULL;                              \
        if (!failed) {                                                                              \
            _Pragma("omp parallel")                                                                 \
            NAME##_team(q, k_cache, v_cache, tables, max_blocks, context, rows, out, S, H, KVH, D, block_size, \
                        window, scale, first, partial, prob, prob_stride);                          \
        }                                                                                           \
        free(prob);                                                                                 \
        free(partial);                                                                              \
        free(first);                                                                                \
        return failed ? -1 : 0;                                                                     \
    }

DEFINE_DECODE_ATTENTION(tandem_decode_attention, float, f32)
DEFINE_DECODE_ATTENTION(tandem_decode_attention_bf16, uint16_t, bf16)

void tandem_team_decode_attention(const float *q, const float *k_cache, const float *v_cache, const int64_t *tables,
                                  long max_blocks, const int64_t *context, const int64_t *rows, float *out, long S,
                                  long H, long KVH, long D, long block_size, long window, float scale, long *first,
                                  float *partial, float *prob, long prob_stride) {
    tandem_decode_attention_team(q, k_cache, v_cache, tables, max_blocks, context, rows, out, S, H, KVH, D,
                                 block_size, window, scale, first, partial, prob, prob_stride);
}
