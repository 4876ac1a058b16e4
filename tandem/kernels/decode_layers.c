/* A decode step's decoder layers in one call: every op of every layer, float32 activations and
 * w8a8 weights, inside one OpenMP region.
 *
 * A decode step of a small model is a few hundred small kernels (Gemma 3 270M: 18 layers of
 * norms, four matmuls, q/k/v into the cache, attention, the activation, residual adds). Called
 * one by one from Python, each pays the interpreter, ctypes and a wake-up of the threads; at
 * batch 1 that was a quarter of the step. Here the threads are woken once and run the layers'
 * ops in order, a barrier between one op and the next (team.h). Each op is the same function the
 * per-op path calls, on the same rows, and the residual adds are one float add each as in torch,
 * so the hidden states are the same bits either way: a sequence's tokens do not depend on
 * whether its step went through here (every row a decode) or op by op (tests/test_decode_layers.py).
 *
 * Two layer shapes: pre-norm (Llama: x += attn(norm(x)); x += mlp(norm(x))) and sandwich
 * (Gemma 3: the attention's and the MLP's outputs are normed again before they are added).
 * Built and loaded by tandem/kernels/native.py; driven by tandem/models/decode_layers.py.
 */
#include <omp.h>
#include <stdint.h>

#include "team.h"

typedef struct {
    const int8_t *weight; /* [N, K] */
    const float *scale;   /* [N] */
    long N, K;
} QLinear;

typedef struct {
    QLinear qkv, o, gate_up, down;
    const float *norm_in, *norm_post_attn; /* Llama: before the attention and before the MLP */
    const float *norm_pre_ffn, *norm_post_ffn; /* sandwich only: NULL otherwise */
    const float *q_norm, *k_norm;              /* NULL: no q/k norm */
    long sliding;                              /* 1: the step's window applies */
    long rope;                                 /* which of the step's cos/sin tables */
} DecodeLayer;

typedef struct {
    long layers, hidden, heads, kv_heads, head_dim, intermediate;
    long act;      /* tandem_act_mul's kind */
    long sandwich; /* 1: Gemma 3's four norms */
    float eps, offset, qk_eps, qk_offset, attn_scale;
    const DecodeLayer *layer;
} DecodeModel;

typedef struct {
    long T;                    /* token rows = sequences, one query each */
    float *x;                  /* [T, hidden], the layers' input, overwritten by their output */
    const float *cos[2], *sin[2]; /* [T, head_dim] per rope table */
    const int64_t *slots;      /* [T]: the cache row each token's k and v go to */
    const int64_t *tables;     /* [T, max_blocks] */
    long max_blocks;
    const int64_t *context;    /* [T] */
    const int64_t *rows;       /* [T]: sequence s's row in x */
    long block_size, window;
    float *kv;                 /* [layers, 2, slots, kv_heads, head_dim] */
    long kv_slots;
} DecodeStep;

/* Where each buffer of a step lies in its scratch (offsets in floats), and the size. */
typedef struct {
    long h, qkv, q, att, proj, gu, act, partial, prob, xs, xq, first, size;
} Layout;

static long up64(long floats) { return (floats + 15) & ~15L; } /* 64-byte boundaries */

static Layout layout(const DecodeModel *m, long T, long parts, long threads) {
    long Hd = m->hidden, H = m->heads, KVH = m->kv_heads, D = m->head_dim, I = m->intermediate, G = H / KVH;
    long widest_in = Hd > H * D ? Hd : H * D;
    widest_in = widest_in > I ? widest_in : I;
    Layout o;
    o.h = 0;                                         /* normed input [T, hidden] */
    o.qkv = up64(o.h + T * Hd);                      /* [T, (H + 2 KVH) D] */
    o.q = up64(o.qkv + T * (H + 2 * KVH) * D);       /* [T, H, D] */
    o.att = up64(o.q + T * H * D);                   /* attention output [T, H, D] */
    o.proj = up64(o.att + T * H * D);                /* a projection's output [T, hidden] */
    o.gu = up64(o.proj + T * Hd);                    /* [T, 2 I] */
    o.act = up64(o.gu + T * 2 * I);                  /* [T, I] */
    o.partial = up64(o.act + T * I);                 /* attention part records */
    o.prob = up64(o.partial + parts * KVH * G * (D + 2) + 1);
    o.xs = up64(o.prob + threads * tandem_decode_attention_prob_floats(G, D));
    o.xq = up64(o.xs + T * widest_in / 16);          /* w8a8 rounded inputs: bytes (before: scales, corrections) */
    o.first = up64(o.xq + (T * widest_in + 3) / 4);  /* attention's first parts: T + 1 longs */
    o.size = up64(o.first + 2 * (T + 1));
    return o;
}

static long count_parts(const int64_t *context, long T) {
    long parts = 0;
    for (long t = 0; t < T; t++) parts += (context[t] + DECODE_PART - 1) / DECODE_PART;
    return parts;
}

/* The scratch floats a step of T rows with these contexts needs on `threads` threads
 * (tandem_decode_layers runs on omp_get_max_threads()). */
long tandem_decode_layers_scratch(const DecodeModel *m, long T, const int64_t *context, long threads) {
    return layout(m, T, count_parts(context, T), threads).size;
}

static void add_rows(float *x, const float *y, long n) {
#pragma omp for schedule(static)
    for (long i = 0; i < n; i++) x[i] += y[i];
}

/* Run every layer on step s, with 64-byte aligned scratch of tandem_decode_layers_scratch's size. */
void tandem_decode_layers(const DecodeModel *m, const DecodeStep *s, float *scratch) {
    long T = s->T, Hd = m->hidden, H = m->heads, KVH = m->kv_heads, D = m->head_dim, I = m->intermediate;
    long threads = omp_get_max_threads(), prob_stride = tandem_decode_attention_prob_floats(H / KVH, D);
    Layout o = layout(m, T, count_parts(s->context, T), threads);
    float *h = scratch + o.h, *qkv = scratch + o.qkv, *q = scratch + o.q, *att = scratch + o.att;
    float *proj = scratch + o.proj, *gu = scratch + o.gu, *act = scratch + o.act, *partial = scratch + o.partial;
    float *prob = scratch + o.prob, *xs = scratch + o.xs;
    int8_t *xq = (int8_t *)(scratch + o.xq);
    long *first = (long *)(scratch + o.first);
    float *x = s->x;
    long layer_floats = s->kv_slots * KVH * D;
#pragma omp parallel
    for (long l = 0; l < m->layers; l++) {
        const DecodeLayer *L = m->layer + l;
        float *k_cache = s->kv + 2 * l * layer_floats, *v_cache = k_cache + layer_floats;
        tandem_team_rms_norm(x, L->norm_in, h, T, Hd, m->eps, m->offset);
        tandem_team_gemm_w8a8(h, L->qkv.weight, L->qkv.scale, qkv, T, L->qkv.N, L->qkv.K, xq, xs);
        tandem_team_qkv_to_cache(qkv, T, H, KVH, D, L->q_norm, L->k_norm, m->qk_eps, m->qk_offset,
                                 s->cos[L->rope], s->sin[L->rope], s->slots, q, k_cache, v_cache);
        tandem_team_decode_attention(q, k_cache, v_cache, s->tables, s->max_blocks, s->context, s->rows, att, T, H,
                                     KVH, D, s->block_size, L->sliding ? s->window : 0, m->attn_scale, first,
                                     partial, prob, prob_stride);
        tandem_team_gemm_w8a8(att, L->o.weight, L->o.scale, proj, T, L->o.N, L->o.K, xq, xs);
        if (m->sandwich) tandem_team_rms_norm(proj, L->norm_post_attn, proj, T, Hd, m->eps, m->offset);
        add_rows(x, proj, T * Hd);
        tandem_team_rms_norm(x, m->sandwich ? L->norm_pre_ffn : L->norm_post_attn, h, T, Hd, m->eps, m->offset);
        tandem_team_gemm_w8a8(h, L->gate_up.weight, L->gate_up.scale, gu, T, L->gate_up.N, L->gate_up.K, xq, xs);
        tandem_team_act_mul(gu, act, T, I, (int)m->act);
        tandem_team_gemm_w8a8(act, L->down.weight, L->down.scale, proj, T, L->down.N, L->down.K, xq, xs);
        if (m->sandwich) tandem_team_rms_norm(proj, L->norm_post_ffn, proj, T, Hd, m->eps, m->offset);
        add_rows(x, proj, T * Hd);
    }
}
