/* The paged KV cache as the decode-attention kernels read it (header only, static inline).
 *
 * Layout: [num_slots, num_kv_heads, head_dim], slot = block * block_size + offset; row s of the
 * block table lists sequence s's blocks in position order. */
#ifndef TANDEM_PAGED_CACHE_H
#define TANDEM_PAGED_CACHE_H

#include <stdint.h>

/* The first key position a query with n keys attends to: n - window on a sliding-window layer
 * (window > 0) once the context is longer than the window, else 0. */
static inline long window_start(long n, long window) { return window > 0 && n > window ? n - window : 0; }

/* The cache row of KV head g at position p of the sequence whose block table row is table. */
static inline long cache_row(const int64_t *table, long p, long block_size, long KVH, long g) {
    return (table[p / block_size] * block_size + p % block_size) * KVH + g;
}

#endif
