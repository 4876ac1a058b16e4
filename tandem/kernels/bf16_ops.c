/* The fused operations of cpu_ops.c for bfloat16 tensors: RMS norm, act(gate) * up, and the
 * q/k norm + rotary + KV-cache write.
 *
 * Tensors are bf16 (uint16_t here); every value is widened to float32, computed on in float32
 * and rounded to bf16 (round to nearest even, simd.h) where tandem/ops/reference.py run in bf16
 * rounds it, so that the kernels give torch's bf16 results: the RMS norm rounds the normed row
 * and, with offset 0, its product with the weight (reference.rms_norm: weight * norm(x).to(bf16));
 * act_mul rounds act(gate), then its product with up. The rotary embedding is the exception:
 * torch rounds x * cos, rotate_half(x) * sin and their sum to bf16 one by one; here the sum is
 * computed in float32 and rounded once, which is closer to the exact value. The same OpenMP
 * row split as the float32 kernels. Built and loaded by tandem/kernels/native.py.
 */
#include <stdint.h>

#include "simd.h"

/* 1 / sqrt(mean(x^2) + eps) over D bf16 values. */
static inline float inv_rms_bf16(const uint16_t *x, long D, float eps) {
    vf acc = vf_zero();
    long k = 0;
    for (; k + VF_LANES <= D; k += VF_LANES) {
        vf v = vf_load_bf16(x + k);
        acc = vf_fmadd(v, v, acc);
    }
    float ss = vf_hsum(acc);
    for (; k < D; k++) {
        float v = bf16_to_f32(x[k]);
        ss += v * v;
    }
    return 1.0f / sqrtf(ss / (float)D + eps);
}

/* One row of D values normed as reference.rms_norm rounds it: offset != 0 (Gemma):
 * bf16(x * inv * (offset + w)); offset 0: bf16(w * bf16(x * inv)). dst may alias x. */
static void norm_row_bf16(const uint16_t *x, const uint16_t *w, uint16_t *dst, long D, float eps, float offset) {
    float inv = inv_rms_bf16(x, D, eps);
    vf vinv = vf_set1(inv), voff = vf_set1(offset);
    long k = 0;
    if (offset != 0.0f) {
        for (; k + VF_LANES <= D; k += VF_LANES) {
            vf g = vf_add(voff, vf_load_bf16(w + k));
            vf_store_bf16(dst + k, vf_mul(vf_mul(vf_load_bf16(x + k), vinv), g));
        }
        for (; k < D; k++) dst[k] = f32_to_bf16(bf16_to_f32(x[k]) * inv * (offset + bf16_to_f32(w[k])));
    } else {
        for (; k + VF_LANES <= D; k += VF_LANES) {
            vf n = vf_round_bf16(vf_mul(vf_load_bf16(x + k), vinv));
            vf_store_bf16(dst + k, vf_mul(vf_load_bf16(w + k), n));
        }
        for (; k < D; k++) dst[k] = f32_to_bf16(bf16_to_f32(w[k]) * bf16_round(bf16_to_f32(x[k]) * inv));
    }
}

/* As tandem_rms_norm, on bf16 rows (w bf16 too). out may alias x. */
void tandem_rms_norm_bf16(const uint16_t *x, const uint16_t *w, uint16_t *out, long rows, long D, float eps,
                          float offset) {
#pragma omp parallel for schedule(static) if (rows * D >= PARALLEL_MIN_ELEMENTS)
    for (long r = 0; r < rows; r++) norm_row_bf16(x + r * D, w, out + r * D, D, eps, offset);
}

/* As tandem_act_mul, on bf16 rows: out = bf16(bf16(act(gate)) * up). Eight lanes in every
 * variant: the exponential is written for them (simd.h). */
void tandem_act_mul_bf16(const uint16_t *gate_up, uint16_t *out, long rows, long I, int kind) {
    float a, b;
    gated_coefficients(kind, &a, &b);
    __m256 va = _mm256_set1_ps(a), vb = _mm256_set1_ps(b);
#pragma omp parallel for schedule(static) if (rows * I >= PARALLEL_MIN_ELEMENTS)
    for (long r = 0; r < rows; r++) {
        const uint16_t *g = gate_up + r * 2 * I, *u = g + I;
        uint16_t *o = out + r * I;
        long k = 0;
        for (; k + 8 <= I; k += 8) {
            __m256 act = bf16x8_round(gated8(bf16x8_load(g + k), va, vb));
            bf16x8_store(o + k, _mm256_mul_ps(act, bf16x8_load(u + k)));
        }
        for (; k < I; k++) o[k] = f32_to_bf16(bf16_round(gated1(bf16_to_f32(g[k]), a, b)) * bf16_to_f32(u[k]));
    }
}

/* Rotate-half rotary embedding of one head's row x into dst (no overlap), in float32 and rounded
 * once: dst[k] = x[k] cos[k] - x[k + D/2] sin[k] in the first half, x[k] cos[k] + x[k - D/2] sin[k]
 * in the second. */
static void rope_row_bf16(const uint16_t *x, uint16_t *dst, long D, const uint16_t *cos, const uint16_t *sin) {
    long half = D / 2;
    long k = 0;
    for (; k + VF_LANES <= half; k += VF_LANES) {
        vf a = vf_load_bf16(x + k), b = vf_load_bf16(x + k + half);
        vf lo = vf_fnmadd(b, vf_load_bf16(sin + k), vf_mul(a, vf_load_bf16(cos + k)));
        vf hi = vf_fmadd(a, vf_load_bf16(sin + k + half), vf_mul(b, vf_load_bf16(cos + k + half)));
        vf_store_bf16(dst + k, lo);
        vf_store_bf16(dst + k + half, hi);
    }
    for (; k < half; k++) {
        float a = bf16_to_f32(x[k]), b = bf16_to_f32(x[k + half]);
        dst[k] = f32_to_bf16(fmaf(-b, bf16_to_f32(sin[k]), a * bf16_to_f32(cos[k])));
        dst[k + half] = f32_to_bf16(fmaf(a, bf16_to_f32(sin[k + half]), b * bf16_to_f32(cos[k + half])));
    }
}

/* One head: normed (w, or not when NULL) as tandem_rms_norm_bf16 norms it, then rotated. */
static void norm_rope_row_bf16(const uint16_t *src, uint16_t *dst, long D, const uint16_t *w, float eps,
                               float offset, const uint16_t *cos, const uint16_t *sin) {
    uint16_t tmp[D];
    if (w != NULL) {
        norm_row_bf16(src, w, tmp, D, eps, offset);
        src = tmp;
    }
    rope_row_bf16(src, dst, D, cos, sin);
}

/* As tandem_qkv_to_cache, on bf16 tensors (qkv, the norm weights, cos/sin, q_out and the caches);
 * v is copied bit for bit. D is even. */
void tandem_qkv_to_cache_bf16(const uint16_t *qkv, long T, long H, long KVH, long D, const uint16_t *q_w,
                              const uint16_t *k_w, float eps, float offset, const uint16_t *cos, const uint16_t *sin,
                              const int64_t *slots, uint16_t *q_out, uint16_t *k_cache, uint16_t *v_cache) {
    long width = (H + 2 * KVH) * D;
#pragma omp parallel for schedule(static) if (T * width >= PARALLEL_MIN_ELEMENTS)
    for (long t = 0; t < T; t++) {
        const uint16_t *row = qkv + t * width, *c = cos + t * D, *s = sin + t * D;
        for (long h = 0; h < H; h++)
            norm_rope_row_bf16(row + h * D, q_out + (t * H + h) * D, D, q_w, eps, offset, c, s);
        for (long g = 0; g < KVH; g++) {
            long dst = (slots[t] * KVH + g) * D;
            norm_rope_row_bf16(row + (H + g) * D, k_cache + dst, D, k_w, eps, offset, c, s);
            memcpy(v_cache + dst, row + (H + KVH + g) * D, sizeof(uint16_t) * (size_t)D);
        }
    }
}
