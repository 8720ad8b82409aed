/* Paged decode attention for CPUs, reading K/V in place from the block cache.
 *
 * PyTorch cannot index the paged cache without first gathering every
 * request's K/V rows into a contiguous copy; on a memory-bound decode that
 * copy (write + read back) triples the bytes moved. This kernel walks each
 * request's block table and reads every cached K and V row exactly once.
 *
 * Layout (per layer): cache[num_blocks][block_size][num_kv_heads][head_dim],
 * float32 or bfloat16. Token t of request r lives in block
 * block_tables[r][t / block_size] at row t % block_size.
 *
 * Decode i reads query row tokens[i], request row seq_index[i] of the block
 * tables and seq_lens, and writes output row out_rows[i].
 *
 * Work item = one decode, all heads: each token's K/V row (every KV head) is
 * loaded once and serves all query heads (GQA). Two passes per item:
 * scores = q.K (then an exact softmax), out = p.V.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_HEADS 256

/* One token's row of `count` values starting at element `first`: read in
 * place for float32; widened into `scratch` for bfloat16. */
static inline const float *token_row(float *scratch, const void *cache, int64_t first, int64_t count, int bf16) {
    if (!bf16)
        return (const float *)cache + first;
    const uint16_t *src = (const uint16_t *)cache + first;
#pragma omp simd
    for (int64_t d = 0; d < count; d++) {
        uint32_t bits = (uint32_t)src[d] << 16;
        float f;
        memcpy(&f, &bits, sizeof f);
        scratch[d] = f;
    }
    return scratch;
}

int paged_decode_attention(
    float *out, int64_t out_tok_stride, int64_t out_head_stride,
    const float *q, int64_t q_tok_stride, int64_t q_head_stride,
    const void *k_cache, const void *v_cache, int cache_bf16,
    const int32_t *block_tables, int64_t block_table_stride,
    const int32_t *seq_lens, const int64_t *tokens, const int64_t *out_rows, const int32_t *seq_index,
    int num_decodes,
    int num_heads, int num_kv_heads, int head_dim, int block_size, int max_seq_len,
    float scale, int num_threads)
{
    const int group = num_heads / num_kv_heads;
    const int64_t row_len = (int64_t)num_kv_heads * head_dim;  /* one token's K (or V), all KV heads */
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        /* Per thread: scores [H][max_seq_len], q [H][D], acc [H][D], one token row [KV*D]. */
        const size_t hd = (size_t)num_heads * head_dim;
        float *scores = malloc(sizeof(float) * ((size_t)num_heads * max_seq_len + 2 * hd + row_len));
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        } else {
            float *qv = scores + (size_t)num_heads * max_seq_len;
            float *acc = qv + hd;
            float *row = acc + hd;
#pragma omp for schedule(dynamic, 1)
            for (int i = 0; i < num_decodes; i++) {
                const int r = seq_index[i], len = seq_lens[r];
                const int32_t *table = block_tables + (int64_t)r * block_table_stride;
                for (int h = 0; h < num_heads; h++) {
                    const float *src = q + tokens[i] * q_tok_stride + (int64_t)h * q_head_stride;
                    for (int d = 0; d < head_dim; d++) qv[h * head_dim + d] = src[d] * scale;
                }
                float maxs[MAX_HEADS], sums[MAX_HEADS];
                for (int h = 0; h < num_heads; h++) maxs[h] = -INFINITY;
                /* Pass 1: every head's score against each cached key, token by token.
                 * A token's K row (all KV heads) is contiguous, and a block's
                 * tokens are contiguous: the reads stream. */
                for (int t = 0; t < len; t++) {
                    const int64_t slot = (int64_t)table[t / block_size] * block_size + t % block_size;
                    const float *krow = token_row(row, k_cache, slot * row_len, row_len, cache_bf16);
                    for (int h = 0; h < num_heads; h++) {
                        const float *qh = qv + h * head_dim, *kh = krow + (h / group) * head_dim;
                        float s = 0.f;
#pragma omp simd reduction(+:s)
                        for (int d = 0; d < head_dim; d++) s += qh[d] * kh[d];
                        scores[(size_t)h * max_seq_len + t] = s;
                        if (s > maxs[h]) maxs[h] = s;
                    }
                }
                for (int h = 0; h < num_heads; h++) {
                    float *sh = scores + (size_t)h * max_seq_len, sum = 0.f;
                    for (int t = 0; t < len; t++) { sh[t] = expf(sh[t] - maxs[h]); sum += sh[t]; }
                    sums[h] = sum;
                }
                /* Pass 2: probability-weighted sum of the values. */
                memset(acc, 0, sizeof(float) * hd);
                for (int t = 0; t < len; t++) {
                    const int64_t slot = (int64_t)table[t / block_size] * block_size + t % block_size;
                    const float *vrow = token_row(row, v_cache, slot * row_len, row_len, cache_bf16);
                    for (int h = 0; h < num_heads; h++) {
                        const float p = scores[(size_t)h * max_seq_len + t];
                        const float *vh = vrow + (h / group) * head_dim;
                        float *ah = acc + h * head_dim;
#pragma omp simd
                        for (int d = 0; d < head_dim; d++) ah[d] += p * vh[d];
                    }
                }
                for (int h = 0; h < num_heads; h++) {
                    float *dst = out + out_rows[i] * out_tok_stride + (int64_t)h * out_head_stride;
                    const float inv = 1.f / sums[h];
                    for (int d = 0; d < head_dim; d++) dst[d] = acc[h * head_dim + d] * inv;
                }
            }
            free(scores);
        }
    }
    return failed ? -1 : 0;
}
