/* Walking a request's block table 16 tokens at a time, shared by the decode
 * and prefill kernels; prefetching the rows found (decode). The including
 * file defines CHUNK (16). */
#ifndef PAGEDSERVE_CHUNK_ROWS_H
#define PAGEDSERVE_CHUNK_ROWS_H
#include <stdint.h>

#ifndef CHUNK
#error "define CHUNK (16) before including chunk_rows.h"
#endif

/* Element offsets of the rows (all KV heads) of tokens t0 .. t0+15, walking
 * the block table with a running (block, offset) instead of a division per
 * token. Past `len`, entries repeat the chunk's first row (scored, then
 * masked out). Returns how many tokens are real. */
static inline int chunk_rows(int64_t *rows, const int32_t *table, int t0, int len, int block_size, int64_t row_len)
{
    const int n = len - t0 < CHUNK ? len - t0 : CHUNK;
    int b = t0 / block_size, off = t0 - b * block_size;
    int64_t base = (int64_t)table[b] * block_size;
    for (int j = 0; j < n; j++) {
        rows[j] = (base + off) * row_len;
        if (++off == block_size && j + 1 < n) {
            off = 0;
            base = (int64_t)table[++b] * block_size;
        }
    }
    for (int j = n; j < CHUNK; j++)
        rows[j] = rows[0];
    return n;
}

/* The two prefetch stages of token j's slice (`bytes` from element `off` of
 * its row, `esz` bytes an element) of K and V: from the chunk after next
 * (rows `far`, n_far real) into L2, and from the next chunk (`next`, n_next)
 * into L1, where L2 has it by then. decode_heads spreads these over a
 * chunk's V pass (paged_decode.c says why), the dot path over its score pass. */
static inline __attribute__((always_inline)) void
prefetch_token(const char *k_cache, const char *v_cache, const int64_t *far, int n_far, const int64_t *next, int n_next,
               int j, int64_t off, int esz, int bytes)
{
    if (j < n_far)
        for (int b = 0; b < bytes; b += 64) {
            __builtin_prefetch(k_cache + (far[j] + off) * esz + b, 0, 2);  /* T1 */
            __builtin_prefetch(v_cache + (far[j] + off) * esz + b, 0, 2);
        }
    if (j < n_next)
        for (int b = 0; b < bytes; b += 64) {
            __builtin_prefetch(k_cache + (next[j] + off) * esz + b, 0, 3);  /* T0 */
            __builtin_prefetch(v_cache + (next[j] + off) * esz + b, 0, 3);
        }
}

/* prefetch_token for share h of G of a chunk's tokens, so that one KV
 * head's prefetches spread over the score passes of its G query heads. */
static inline __attribute__((always_inline)) void
prefetch_share(const char *k_cache, const char *v_cache, const int64_t *far, int n_far, const int64_t *next, int n_next,
               int h, int G, int64_t off, int esz, int bytes)
{
    for (int j = h * CHUNK / G; j < (h + 1) * CHUNK / G; j++)
        prefetch_token(k_cache, v_cache, far, n_far, next, n_next, j, off, esz, bytes);
}

#endif
