/* Small fused float32 operations for the CPU forward pass (AVX2 + FMA).
 *
 * Each of these is several torch operators in a row, each of which reads and writes the whole
 * tensor and pays its own dispatch: an RMS norm is seven of them, a gated activation four, and
 * in a decode step of a small model that overhead, not the arithmetic, is most of their time.
 * One pass each here. Rows are split across OpenMP threads only when there is enough work to pay
 * for waking them. Built and loaded by tandem/kernels/native.py.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include "simd.h"
#include "team.h"

/* 1 / sqrt(mean(x^2) + eps) over D values. */
static inline float inv_rms(const float *x, long D, float eps) {
    __m256 acc = _mm256_setzero_ps();
    long k = 0;
    for (; k + 8 <= D; k += 8) {
        __m256 v = _mm256_loadu_ps(x + k);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    float ss = hsum8(acc);
    for (; k < D; k++) ss += x[k] * x[k];
    return 1.0f / sqrtf(ss / (float)D + eps);
}

/* out[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * (offset + w), rows of length D.
 * offset is 1 for Gemma's norms (weights stored as w - 1) and 0 otherwise. out may alias x. */
void tandem_team_rms_norm(const float *x, const float *w, float *out, long rows, long D, float eps, float offset) {
#pragma omp for schedule(static)
    for (long r = 0; r < rows; r++) {
        const float *xr = x + r * D;
        float *yr = out + r * D;
        float inv = inv_rms(xr, D, eps);
        __m256 vinv = _mm256_set1_ps(inv), voff = _mm256_set1_ps(offset);
        long k = 0;
        for (; k + 8 <= D; k += 8) {
            __m256 g = _mm256_add_ps(voff, _mm256_loadu_ps(w + k));
            _mm256_storeu_ps(yr + k, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + k), vinv), g));
        }
        for (; k < D; k++) yr[k] = xr[k] * inv * (offset + w[k]);
    }
}

void tandem_rms_norm(const float *x, const float *w, float *out, long rows, long D, float eps, float offset) {
#pragma omp parallel if (rows * D >= PARALLEL_MIN_ELEMENTS)
    tandem_team_rms_norm(x, w, out, rows, D, eps, offset);
}

/* gate_up: [rows, 2 * I] (gate in the first half of each row, up in the second);
 * out[r, i] = act(gate[r, i]) * up[r, i]. kind 0: SiLU, 1: GELU (tanh form). */
void tandem_team_act_mul(const float *gate_up, float *out, long rows, long I, int kind) {
    float a, b;
    gated_coefficients(kind, &a, &b);
    __m256 va = _mm256_set1_ps(a), vb = _mm256_set1_ps(b);
#pragma omp for schedule(static)
    for (long r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * I, *u = g + I;
        float *o = out + r * I;
        long k = 0;
        for (; k + 8 <= I; k += 8)
            _mm256_storeu_ps(o + k, _mm256_mul_ps(gated8(_mm256_loadu_ps(g + k), va, vb), _mm256_loadu_ps(u + k)));
        for (; k < I; k++) o[k] = gated1(g[k], a, b) * u[k];
    }
}

void tandem_act_mul(const float *gate_up, float *out, long rows, long I, int kind) {
#pragma omp parallel if (rows * I >= PARALLEL_MIN_ELEMENTS)
    tandem_team_act_mul(gate_up, out, rows, I, kind);
}

/* The largest value of x[k0 .. k1) and its index (the first one on ties; -1 if every value is
 * NaN or -inf), in *m and *arg. */
static void argmax_span(const float *x, long k0, long k1, float *m, long *arg) {
    __m256 best = _mm256_set1_ps(-INFINITY);
    __m256i best_i = _mm256_set1_epi32(-1);
    __m256i idx = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32((int)k0));
    __m256i step = _mm256_set1_epi32(8);
    long k = k0;
    for (; k + 8 <= k1; k += 8) {
        __m256 v = _mm256_loadu_ps(x + k);
        __m256 gt = _mm256_cmp_ps(v, best, _CMP_GT_OQ);  /* strict: the first index stays */
        best = _mm256_blendv_ps(best, v, gt);
        best_i = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(best_i), _mm256_castsi256_ps(idx), gt));
        idx = _mm256_add_epi32(idx, step);
    }
    float bv[8];
    int32_t bi[8];
    _mm256_storeu_ps(bv, best);
    _mm256_storeu_si256((__m256i *)bi, best_i);
    float bm = -INFINITY;
    long ba = -1;
    for (int l = 0; l < 8; l++)
        if (bi[l] >= 0 && (bv[l] > bm || (bv[l] == bm && bi[l] < ba))) {
            bm = bv[l];
            ba = bi[l];
        }
    for (; k < k1; k++)
        if (x[k] > bm) {
            bm = x[k];
            ba = k;
        }
    *m = bm;
    *arg = ba;
}

/* Spans of a row handed to the threads when there are fewer rows than threads (greedy decode at
 * batch 1: one row of 262,144 logits). */
#define ARGMAX_SPANS 8

/* out[r] = index of the largest value of row r (the first one on ties); NaNs are never chosen.
 * Exact whichever way a row is split, so the result never depends on the batch. */
void tandem_argmax_rows(const float *x, int64_t *out, long rows, long N) {
    if (rows < omp_get_max_threads() && N >= 4 * PARALLEL_MIN_ELEMENTS) {
        for (long r = 0; r < rows; r++) {
            float m[ARGMAX_SPANS];
            long arg[ARGMAX_SPANS], span = (N + ARGMAX_SPANS - 1) / ARGMAX_SPANS;
#pragma omp parallel for schedule(static)
            for (int p = 0; p < ARGMAX_SPANS; p++) {
                long k0 = p * span, k1 = k0 + span < N ? k0 + span : N;
                argmax_span(x + r * N, k0 < N ? k0 : N, k1, &m[p], &arg[p]);
            }
            float bm = -INFINITY;
            long ba = -1;
            for (int p = 0; p < ARGMAX_SPANS; p++) /* in order, strictly greater: the first index stays */
                if (arg[p] >= 0 && (ba < 0 || m[p] > bm)) {
                    bm = m[p];
                    ba = arg[p];
                }
            out[r] = ba < 0 ? 0 : ba;
        }
        return;
    }
#pragma omp parallel for schedule(static) if (rows * N >= 4 * PARALLEL_MIN_ELEMENTS)
    for (long r = 0; r < rows; r++) {
        float m;
        long arg;
        argmax_span(x + r * N, 0, N, &m, &arg);
        out[r] = arg < 0 ? 0 : arg;
    }
}

/* One head's row: optional RMS norm times (offset + w), then rotate-half rotary embedding with
 * this token's cos/sin rows, written to dst. src and dst do not overlap. */
static void norm_rope_row(const float *src, float *dst, long D, const float *w, float eps, float offset,
                          const float *cos, const float *sin) {
    float tmp[D];
    const float *x = src;
    if (w != NULL) {
        float inv = inv_rms(src, D, eps);
        for (long k = 0; k < D; k++) tmp[k] = src[k] * inv * (offset + w[k]);
        x = tmp;
    }
    long half = D / 2;
    for (long k = 0; k < half; k++) dst[k] = x[k] * cos[k] - x[k + half] * sin[k];
    for (long k = half; k < D; k++) dst[k] = x[k] * cos[k] + x[k - half] * sin[k];
}

/* The merged q/k/v projection's output [T, (H + 2 KVH) * D] made ready for attention in one pass:
 * q heads normed (q_w, or none when NULL) and rotated into q_out [T, H, D]; k heads normed
 * (k_w) and rotated, and v heads copied, straight into the cache rows slots[t] of
 * k_cache/v_cache [slots, KVH, D]. cos/sin: [T, D], the rows of each token's position. */
void tandem_team_qkv_to_cache(const float *qkv, long T, long H, long KVH, long D, const float *q_w, const float *k_w,
                              float eps, float offset, const float *cos, const float *sin, const int64_t *slots,
                              float *q_out, float *k_cache, float *v_cache) {
    long width = (H + 2 * KVH) * D;
#pragma omp for schedule(static)
    for (long t = 0; t < T; t++) {
        const float *row = qkv + t * width, *c = cos + t * D, *s = sin + t * D;
        for (long h = 0; h < H; h++) norm_rope_row(row + h * D, q_out + (t * H + h) * D, D, q_w, eps, offset, c, s);
        for (long g = 0; g < KVH; g++) {
            norm_rope_row(row + (H + g) * D, k_cache + (slots[t] * KVH + g) * D, D, k_w, eps, offset, c, s);
            const float *v = row + (H + KVH + g) * D;
            float *dst = v_cache + (slots[t] * KVH + g) * D;
            for (long k = 0; k < D; k++) dst[k] = v[k];
        }
    }
}

void tandem_qkv_to_cache(const float *qkv, long T, long H, long KVH, long D, const float *q_w, const float *k_w,
                         float eps, float offset, const float *cos, const float *sin, const int64_t *slots,
                         float *q_out, float *k_cache, float *v_cache) {
#pragma omp parallel if (T * (H + 2 * KVH) * D >= PARALLEL_MIN_ELEMENTS)
    tandem_team_qkv_to_cache(qkv, T, H, KVH, D, q_w, k_w, eps, offset, cos, sin, slots, q_out, k_cache, v_cache);
}
