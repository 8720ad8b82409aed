/* decode_heads (paged_decode.c) over a bfloat16 cache with the bf16 dot
 * product, VDPBF16PS: raw bf16 K/V rows multiplied in place, two values per
 * 32-bit lane, instead of widened to float32 first.
 *
 * Included twice by paged_decode.c, with DOT_NAME(x) naming this instance's
 * functions, DOT_TARGET its target attribute and DOT(acc, a, b) its pair
 * product (the instruction, or native/bf16_dot.h's emulation of it).
 *
 * Why: per 64-byte line of K (32 bf16 values) the widening path spends two
 * loads, two widenings and 2 x G float32 FMAs (G query heads per KV head);
 * this spends one load and G VDPBF16PS. On a core that streams K/V faster
 * than it can widen and multiply them, that is the difference between
 * compute and memory bound. The price is rounding: the queries and the
 * softmax probabilities are rounded to bfloat16 (the cache already is), as
 * bf16 attention in torch and oneDNN rounds them, so outputs differ from the
 * widening path's by bf16 rounding. paged_decode_attention runs this only
 * when asked (the `bf16` bits BF16_DOT / BF16_DOT_EMULATED), which
 * attention/routes.py's start-up timing does where it measures faster.
 *
 *   Q.K  a lane pairs dims (2i, 2i+1) of the query and of a key row: one
 *        64-byte load of raw K is 16 lanes, summed by sum16 as before, then
 *        scaled (the queries are rounded unscaled, so a scale that is not a
 *        power of two adds no rounding).
 *   P.V  a lane pairs tokens (j, j+1): the probabilities' pair is one 32-bit
 *        broadcast, and the V rows of the two tokens are interleaved 16 bits
 *        at a time (unpacklo/hi_epi16). That interleave works within 128-bit
 *        lanes, so accumulator "lo" of a 32-dim line holds dims 0-3, 8-11,
 *        16-19, 24-27 and "hi" the other half; they are put back in order
 *        once, at the end. The running sum l adds the rounded probabilities,
 *        so the weights still sum to one exactly as used.
 *   max  kept lazily (lazy_rescale, paged_decode.c), and l lane-wise until
 *        the end: no horizontal reduction on most chunks.
 */

static inline __attribute__((always_inline)) DOT_TARGET void DOT_NAME(decode_heads)(
    const int G, const int NC, float *out, int64_t out_head_stride, const float *q, int64_t q_head_stride,
    const void *k_cache, const void *v_cache, const int32_t *table, int len, int block_size, int64_t row_len,
    int kv_first, int kv_count, float scale)
{
    const int ND = NC / 2; /* 64-byte lines of one head's row: 32 bf16 values each */
    uint16_t qb[MAX_ITEM_HEADS][128], pb[MAX_ITEM_HEADS][CHUNK];
    float m[MAX_ITEM_HEADS];
    __m512 l[MAX_ITEM_HEADS]; /* lane-wise running sums, added up once at the end */
    __m512 acc_mem[MAX_ITEM_HEADS][8]; /* [hh][2 * line + (0 lo, 1 hi)] */
    for (int hh = 0; hh < kv_count * G; hh++) {
        const float *src = q + (int64_t)(kv_first * G + hh) * q_head_stride;
        for (int d = 0; d < NC * 16; d++) qb[hh][d] = round_bf16(src[d]);
        for (int c = 0; c < NC; c++) acc_mem[hh][c] = _mm512_setzero_ps();
        m[hh] = -INFINITY;
        l[hh] = _mm512_setzero_ps();
    }
    const uint16_t *kc = (const uint16_t *)k_cache, *vc = (const uint16_t *)v_cache;
    const int64_t first_off = (int64_t)kv_first * NC * 16;
    int64_t rows_a[CHUNK], rows_b[CHUNK], rows_c[CHUNK], *rows = rows_a, *next = rows_b, *far = rows_c;
    chunk_rows(rows, table, 0, len, block_size, row_len);
    int n_next = CHUNK < len ? chunk_rows(next, table, CHUNK, len, block_size, row_len) : 0;
    for (int t0 = 0; t0 < len; t0 += CHUNK) {
        const int n = len - t0 < CHUNK ? len - t0 : CHUNK;
        const __mmask16 valid = (__mmask16)((1u << n) - 1);
        /* The next two chunks' rows, prefetched in two stages as decode_heads does, spread over
         * this chunk's score pass (prefetch_share: each query head issues its share of its KV head's). */
        const int n_far = t0 + 2 * CHUNK < len ? chunk_rows(far, table, t0 + 2 * CHUNK, len, block_size, row_len) : 0;
        /* Two passes over the KV heads: the scores and probabilities of all
         * of them, then their P.V. Each head's softmax is a chain of
         * dependent steps (sum16, exp, rounding) that the out-of-order core
         * can only overlap with work independent of it and near it in program
         * order: the next head's Q.K, the first heads' P.V. Interleaved per
         * KV head as decode_heads does, the same arithmetic ran 1.1-1.3x
         * slower on an AMD EPYC with AVX512-BF16, where the old kernel ran in
         * half the time without its softmax (docs/optimization_log.md). */
        for (int kv = 0; kv < kv_count; kv++) {
            const int64_t off = first_off + (int64_t)kv * NC * 16;
#pragma GCC unroll 8
            for (int h = 0; h < G; h++) {
                const int hh = kv * G + h;
                __m512 part[CHUNK];
#pragma GCC unroll 16
                for (int j = 0; j < CHUNK; j++) part[j] = _mm512_setzero_ps();
#pragma GCC unroll 4
                for (int c = 0; c < ND; c++) {
                    const __m512i qc = _mm512_loadu_si512((const void *)(qb[hh] + 32 * c));
#pragma GCC unroll 16
                    for (int j = 0; j < CHUNK; j++)
                        part[j] = DOT(part[j], qc, _mm512_loadu_si512((const void *)(kc + rows[j] + off + 32 * c)));
                }
                const __m512 s = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid,
                                                    _mm512_mul_ps(sum16(part), _mm512_set1_ps(scale)));
                prefetch_share((const char *)kc, (const char *)vc, far, n_far, next, n_next, h, G, off, 2, NC * 32);
                lazy_rescale(s, &m[hh], &l[hh], acc_mem[hh], NC);
                const __m256i e = bf16_round(_mm512_maskz_mov_ps(valid, exp512(_mm512_sub_ps(s, _mm512_set1_ps(m[hh])))));
                l[hh] = _mm512_add_ps(l[hh], bf16_widen(e));
                _mm256_storeu_si256((__m256i *)pb[hh], e);
            }
        }
        for (int kv = 0; kv < kv_count; kv++) {
            const int64_t off = first_off + (int64_t)kv * NC * 16;
            __m512 acc[8][8];
#pragma GCC unroll 8
            for (int h = 0; h < G; h++)
#pragma GCC unroll 8
                for (int c = 0; c < NC; c++) acc[h][c] = acc_mem[kv * G + h][c];
            for (int j = 0; j < n; j += 2) {
                /* Token j + 1 past the chunk's end: probability 0, row rows[0]'s (finite). */
#pragma GCC unroll 4
                for (int c = 0; c < ND; c++) {
                    const __m512i va = _mm512_loadu_si512((const void *)(vc + rows[j] + off + 32 * c));
                    const __m512i vb = _mm512_loadu_si512((const void *)(vc + rows[j + 1] + off + 32 * c));
                    const __m512i lo = _mm512_unpacklo_epi16(va, vb), hi = _mm512_unpackhi_epi16(va, vb);
#pragma GCC unroll 8
                    for (int h = 0; h < G; h++) {
                        int32_t pair;
                        __builtin_memcpy(&pair, pb[kv * G + h] + j, sizeof pair);
                        const __m512i p = _mm512_set1_epi32(pair);
                        acc[h][2 * c] = DOT(acc[h][2 * c], p, lo);
                        acc[h][2 * c + 1] = DOT(acc[h][2 * c + 1], p, hi);
                    }
                }
            }
#pragma GCC unroll 8
            for (int h = 0; h < G; h++)
#pragma GCC unroll 8
                for (int c = 0; c < NC; c++) acc_mem[kv * G + h][c] = acc[h][c];
        }
        int64_t *swap = rows;
        rows = next;
        next = far;
        far = swap;
        n_next = n_far;
    }
    /* Dims back in order: line c's "lo" holds 0-3, 8-11, 16-19, 24-27 in its 128-bit lanes, "hi" the rest. */
    const __m512i first = unpack_order(0), second = unpack_order(1);
    for (int hh = 0; hh < kv_count * G; hh++) {
        const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(l[hh]));
        float *dst = out + (int64_t)(kv_first * G + hh) * out_head_stride;
        for (int c = 0; c < ND; c++) {
            const __m512 lo = acc_mem[hh][2 * c], hi = acc_mem[hh][2 * c + 1];
            _mm512_storeu_ps(dst + 32 * c, _mm512_mul_ps(_mm512_permutex2var_ps(lo, first, hi), inv));
            _mm512_storeu_ps(dst + 32 * c + 16, _mm512_mul_ps(_mm512_permutex2var_ps(lo, second, hi), inv));
        }
    }
}

/* One instance per (heads per KV head, head_dim / 16). */
#define DOT_INSTANCE(G, NC)                                                                                        \
    static DOT_TARGET void DOT_NAME(decode_##G##_##NC)(float *o, int64_t os, const float *q, int64_t qs,           \
                                                       const void *k, const void *v, const int32_t *t, int len,   \
                                                       int bs, int64_t rl, int kv, int nkv, float sc) {           \
        DOT_NAME(decode_heads)(G, NC, o, os, q, qs, k, v, t, len, bs, rl, kv, nkv, sc);                            \
    }
#define DOT_INSTANCES(G) DOT_INSTANCE(G, 4) DOT_INSTANCE(G, 8)
DOT_INSTANCES(1) DOT_INSTANCES(2) DOT_INSTANCES(3) DOT_INSTANCES(4)
DOT_INSTANCES(5) DOT_INSTANCES(6) DOT_INSTANCES(7) DOT_INSTANCES(8)
#undef DOT_INSTANCES
#undef DOT_INSTANCE

#define DOT_GROUP(G) {DOT_NAME(decode_##G##_4), DOT_NAME(decode_##G##_8)}
static const decode_fn DOT_NAME(DECODE_FNS)[8][2] = {DOT_GROUP(1), DOT_GROUP(2), DOT_GROUP(3), DOT_GROUP(4),
                                                     DOT_GROUP(5), DOT_GROUP(6), DOT_GROUP(7), DOT_GROUP(8)};
#undef DOT_GROUP
