/* Weight-only int8 matrix multiply for the CPU (AVX2 + FMA), the decode-sized case.
 *
 *   y[m, n] = scale[n] * sum_k x[m, k] * w[n, k]      x: float32 [M, K], w: int8 [N, K]
 *
 * Decode is bound by reading the weights; int8 weights are a quarter of float32's bytes. Each
 * weight is widened to float32 in registers and multiplied in float32, so the only error is the
 * weights' rounding. Two weight rows by four input rows per register block: the weights are
 * read once per block of four inputs. Rows of N are split across OpenMP threads (the same
 * libgomp torch uses, so one thread pool). Built and loaded by tandem/kernels/native.py.
 */
#include <immintrin.h>
#include <stdint.h>

static inline float hsum(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

static inline __m256 widen8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* Rows m0 .. m0+mm (mm <= 4) against weight rows n, n+1 (w1 == w0 when only one is left). */
static inline __attribute__((always_inline)) void block(const float *x, const int8_t *w0, const int8_t *w1, long mm, long K, float out[4][2]) {
    __m256 a[4][2];
    for (int i = 0; i < 4; i++) a[i][0] = a[i][1] = _mm256_setzero_ps();
    long k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 v0 = widen8(w0 + k), v1 = widen8(w1 + k);
        for (int i = 0; i < 4; i++) {
            if (i >= mm) break;
            __m256 xv = _mm256_loadu_ps(x + i * K + k);
            a[i][0] = _mm256_fmadd_ps(xv, v0, a[i][0]);
            a[i][1] = _mm256_fmadd_ps(xv, v1, a[i][1]);
        }
    }
    for (int i = 0; i < mm; i++) {
        float s0 = hsum(a[i][0]), s1 = hsum(a[i][1]);
        for (long t = k; t < K; t++) {
            s0 += x[i * K + t] * (float)w0[t];
            s1 += x[i * K + t] * (float)w1[t];
        }
        out[i][0] = s0;
        out[i][1] = s1;
    }
}

void tandem_gemm_i8(const float *x, const int8_t *w, const float *scale, float *y, long M, long N, long K) {
    long pairs = (N + 1) / 2;
#pragma omp parallel for schedule(static)
    for (long p = 0; p < pairs; p++) {
        long n = 2 * p;
        int two = n + 1 < N;
        const int8_t *w0 = w + n * K, *w1 = two ? w0 + K : w0;
        for (long m = 0; m < M; m += 4) {
            long mm = M - m < 4 ? M - m : 4;
            float out[4][2];
            /* Constant row counts let the compiler keep every accumulator in a register. */
            if (mm == 4) block(x + m * K, w0, w1, 4, K, out);
            else if (mm == 1) block(x + m * K, w0, w1, 1, K, out);
            else block(x + m * K, w0, w1, mm, K, out);
            for (long i = 0; i < mm; i++) {
                y[(m + i) * N + n] = out[i][0] * scale[n];
                if (two) y[(m + i) * N + n + 1] = out[i][1] * scale[n + 1];
            }
        }
    }
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
