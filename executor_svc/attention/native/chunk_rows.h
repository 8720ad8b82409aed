/* Walking a request's block table 16 tokens at a time, shared by the decode
 * and prefill kernels. The including file defines CHUNK (16). */
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

#endif
