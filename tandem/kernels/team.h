/* The kernels' bodies as work shared by a team of OpenMP threads that is already running.
 *
 * Each function divides its work with orphaned `omp for` loops (each ends with a barrier, so
 * its output is complete when it returns) and must be called by every thread of the team. Called
 * outside a parallel region, it runs on the calling thread alone. The public kernels
 * (tandem_rms_norm, tandem_gemm_w8a8, ...) open a region and call these; the fused decode layers
 * (decode_layers.c) call them one after another inside a single region, so a decode step wakes
 * the threads once instead of a few hundred times. Same code either way: a row's result is the
 * same bits whichever entry point computed it.
 */
#ifndef TANDEM_TEAM_H
#define TANDEM_TEAM_H

#include <stdint.h>

/* Positions per part of a sequence's context in the decode attention (decode_attention.c). */
#define DECODE_PART 128

void tandem_team_rms_norm(const float *x, const float *w, float *out, long rows, long D, float eps, float offset);
void tandem_team_act_mul(const float *gate_up, float *out, long rows, long I, int kind);
void tandem_team_qkv_to_cache(const float *qkv, long T, long H, long KVH, long D, const float *q_w,
                              const float *k_w, float eps, float offset, const float *cos, const float *sin,
                              const int64_t *slots, float *q_out, float *k_cache, float *v_cache);
void tandem_team_gemm_w8a8(const float *x, const int8_t *w, const float *scale, float *y, long M, long N, long K,
                           int8_t *xq, float *xs);
/* packed_w8a8.c: 1 where this build multiplies an [N, K] w8a8 weight packed in groups of 16 rows
 * (AMX tiles or AVX-512 VNNI; the w8a8 entry points then take it so), else 0; the product on
 * already rounded inputs xq / xs. The VNNI build takes its packed weights plus 128 (each byte
 * xor tandem_w8a8_weight_xor()) and, after the M * K / 32 scales xs, one int32 per row and block:
 * minus 128 times the block's rounded inputs' sum (W8A8_BLOCK_SUMS: int8_gemm.c's rounding writes
 * them). */
long tandem_w8a8_packs(long N, long K);
long tandem_w8a8_weight_xor(void);
#if defined(__AVX512VNNI__) && !defined(__AMX_INT8__)
#define W8A8_BLOCK_SUMS 1 /* vpdpbusd multiplies unsigned by signed bytes: the weights carry the offset */
#else
#define W8A8_BLOCK_SUMS 0 /* tdpbssd multiplies signed bytes by signed bytes */
#endif
void tandem_team_gemm_w8a8_packed(const int8_t *xq, const float *xs, const int8_t *wp, const float *scale, float *y,
                                  long M, long N, long K);
void tandem_team_w8a8_packed_argmax(const int8_t *xq, const float *xs, const int8_t *wp, const float *scale,
                                    int64_t *out, long M, long N, long K, float *scratch);

/* Scratch of the float32 decode attention: first [S + 1] longs, partial [parts * KVH * G * (D + 2)]
 * floats (parts: the sum over sequences of their parts, see decode_attention_parts), and per
 * thread prob_stride floats at prob + thread * prob_stride (decode_attention_prob_floats). */
long tandem_decode_attention_parts(const int64_t *context, long S, long window);
long tandem_decode_attention_prob_floats(long G, long D);
void tandem_team_decode_attention(const float *q, const float *k_cache, const float *v_cache, const int64_t *tables,
                                  long max_blocks, const int64_t *context, const int64_t *rows, float *out, long S,
                                  long H, long KVH, long D, long block_size, long window, float scale, long *first,
                                  float *partial, float *prob, long prob_stride);

#endif
