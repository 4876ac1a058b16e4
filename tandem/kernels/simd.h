/* SIMD helpers shared by the kernels in this folder (header only, static inline): AVX2 + FMA
 * always, AVX-512 where the variant's flags define __AVX512F__. */
#ifndef TANDEM_SIMD_H
#define TANDEM_SIMD_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* Row loops are split across OpenMP threads only from this many elements on: below it, waking
 * the threads costs more than the work. */
#define PARALLEL_MIN_ELEMENTS 32768

static inline float hsum8(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

/* exp(x) for float32 lanes: x = n ln2 + r with |r| <= ln2 / 2, exp(r) by a degree-6 polynomial,
 * 2^n added to the exponent bits. Relative error about 2e-7; inputs clamped to [-87, 88], so
 * exp(-inf) comes out as about 1.6e-38, not 0. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* x * sigmoid(a * x + b * x^3): SiLU with a = 1, b = 0; GELU (tanh form) with
 * a = 2 sqrt(2 / pi), b = a * 0.044715, since 0.5 (1 + tanh(u)) = sigmoid(2u). */
static inline __m256 gated8(__m256 x, __m256 a, __m256 b) {
    __m256 x2 = _mm256_mul_ps(x, x);
    __m256 z = _mm256_mul_ps(x, _mm256_fmadd_ps(b, x2, a));
    __m256 den = _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), z)));
    return _mm256_div_ps(x, den);
}

/* gated8's a and b for act_mul's kind: 0 SiLU, 1 GELU (tanh form). */
static inline void gated_coefficients(int kind, float *a, float *b) {
    *a = kind == 0 ? 1.0f : 1.5957691216057308f; /* 2 sqrt(2 / pi) */
    *b = kind == 0 ? 0.0f : 1.5957691216057308f * 0.044715f;
}

static inline float gated1(float x, float a, float b) {
    float z = x * (a + b * x * x);
    return x / (1.0f + expf(-z));
}

/* bfloat16 <-> float32 with integer operations. A bf16 value is the upper half of a float32's
 * bits: widening shifts it left by 16; narrowing rounds to nearest, ties to even (add 0x7fff
 * plus the lowest kept bit, drop the lower 16 bits), so finite values too large round to
 * infinity, as in torch; a NaN stays a NaN (quieted, its sign kept) instead of being rounded. */
static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* f rounded to the nearest bf16 value, kept as a float32. */
static inline float bf16_round(float f) { return bf16_to_f32(f32_to_bf16(f)); }

static inline __m256 bf16x8_load(const uint16_t *p) {
    __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
}

/* Each lane's bf16 bits, rounded as f32_to_bf16 rounds, in the low half of its 32 bits. */
static inline __m256i bf16x8_bits(__m256 v) {
    __m256i bits = _mm256_castps_si256(v);
    __m256i high = _mm256_srli_epi32(bits, 16);
    __m256i bias = _mm256_add_epi32(_mm256_and_si256(high, _mm256_set1_epi32(1)), _mm256_set1_epi32(0x7fff));
    __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, bias), 16);
    __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff)),
                                     _mm256_set1_epi32(0x7f800000));
    return _mm256_blendv_epi8(rounded, _mm256_or_si256(high, _mm256_set1_epi32(0x40)), nan);
}

static inline void bf16x8_store(uint16_t *p, __m256 v) {
    __m256i b = bf16x8_bits(v);
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
}

static inline __m256 bf16x8_round(__m256 v) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16x8_bits(v), 16)); }

/* vf: the widest float32 vector the variant has (16 lanes with AVX-512, else 8), for the loops
 * that only load, multiply-add and sum. */
#ifdef __AVX512F__
#define VF_LANES 16
typedef __m512 vf;

static inline __m512i bf16x16_bits(__m512 v) {
    __m512i bits = _mm512_castps_si512(v);
    __m512i high = _mm512_srli_epi32(bits, 16);
    __m512i bias = _mm512_add_epi32(_mm512_and_si512(high, _mm512_set1_epi32(1)), _mm512_set1_epi32(0x7fff));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
    __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)),
                                            _mm512_set1_epi32(0x7f800000));
    return _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(high, _mm512_set1_epi32(0x40)));
}

static inline vf vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf vf_set1(float x) { return _mm512_set1_ps(x); }
static inline vf vf_loadu(const float *p) { return _mm512_loadu_ps(p); }
static inline void vf_storeu(float *p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vf_fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vf_fnmadd(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }
static inline float vf_hsum(vf v) { return _mm512_reduce_add_ps(v); }
static inline vf vf_load_bf16(const uint16_t *p) {
    __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
}
static inline void vf_store_bf16(uint16_t *p, vf v) {
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(bf16x16_bits(v)));
}
static inline vf vf_round_bf16(vf v) { return _mm512_castsi512_ps(_mm512_slli_epi32(bf16x16_bits(v), 16)); }
#else
#define VF_LANES 8
typedef __m256 vf;

static inline vf vf_zero(void) { return _mm256_setzero_ps(); }
static inline vf vf_set1(float x) { return _mm256_set1_ps(x); }
static inline vf vf_loadu(const float *p) { return _mm256_loadu_ps(p); }
static inline void vf_storeu(float *p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf vf_add(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vf_fmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vf_fnmadd(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
static inline float vf_hsum(vf v) { return hsum8(v); }
static inline vf vf_load_bf16(const uint16_t *p) { return bf16x8_load(p); }
static inline void vf_store_bf16(uint16_t *p, vf v) { bf16x8_store(p, v); }
static inline vf vf_round_bf16(vf v) { return bf16x8_round(v); }
#endif

#endif
