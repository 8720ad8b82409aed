/* prefill_item (paged_prefill.c) over a bfloat16 cache with the bf16 dot
 * product, VDPBF16PS: both matrix products take two bf16 values per 32-bit
 * lane, so a key (or value) pair costs one instruction per 16 query rows
 * where the widening kernel spends a widening copy and two FMAs.
 *
 * Included twice by paged_prefill.c, with DOT_NAME(x) naming this instance's
 * functions, DOT_TARGET its target attribute and DOT(acc, a, b) its pair
 * product (the instruction, or native/bf16_dot.h's emulation of it).
 *
 * Rounding, as decode_dot.h's: the queries are rounded to bfloat16 unscaled
 * (the scale multiplies the float32 scores), the softmax probabilities are
 * rounded to bfloat16 and the running sum l adds the rounded values, so the
 * weights used still sum to one.
 *
 *   Q.K  rows in lanes as in the widening kernel, each lane holding a row's
 *        pair of dims (2e, 2e+1): qt2[e][r]; a key's pair of dims is one
 *        32-bit broadcast straight from the raw bf16 chunk.
 *   P.V  a lane pairs keys (2i, 2i+1) of its row: the rounded probabilities
 *        of the two keys packed into one vector; the value pair
 *        (V[2i][d], V[2i+1][d]) is one 32-bit broadcast from vpair, the
 *        chunk's V rows interleaved two at a time once per chunk.
 */

/* S of one 16-key chunk for NG (1-3) groups of 16 rows, into scores[g * CHUNK + j],
 * scaled: as chunk_scores, over pairs of dims. k: the chunk's raw bf16 rows, [16][D]. */
static inline __attribute__((always_inline)) DOT_TARGET void DOT_NAME(chunk_scores)(
    const int D, const int NG, const uint32_t *k, const uint32_t *qt2, int rv, float scale, __m512 *scores)
{
    for (int h = 0; h < CHUNK; h += 8) {
        __m512 acc[3][8];
        for (int g = 0; g < NG; g++)
            for (int j = 0; j < 8; j++) acc[g][j] = _mm512_setzero_ps();
        for (int e = 0; e < D / 2; e++) {
            __m512i q[3];
            for (int g = 0; g < NG; g++) q[g] = _mm512_loadu_si512((const void *)(qt2 + (int64_t)e * rv + 16 * g));
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {
                const __m512i kb = _mm512_set1_epi32((int)k[(h + j) * (D / 2) + e]);
                for (int g = 0; g < NG; g++) acc[g][j] = DOT(acc[g][j], q[g], kb);
            }
        }
        for (int g = 0; g < NG; g++)
            for (int j = 0; j < 8; j++) scores[g * CHUNK + h + j] = _mm512_mul_ps(acc[g][j], _mm512_set1_ps(scale));
    }
}

/* p times V for NG (1-3) groups of 16 rows at once: ot[d] (group g's
 * vectors at ot + 16 g, stride rv) = ot[d] * alpha[g] + sum_i pp[g][i] .
 * vpair[i][d], where pp packs p (rounded to bf16 by chunk_softmax) two keys
 * a lane; 8 d's at a time in registers, each value-pair broadcast feeding
 * NG products (as chunk_pv in paged_prefill.c). */
static inline __attribute__((always_inline)) DOT_TARGET void DOT_NAME(chunk_pv)(
    const int D, const int NG, const __m512 *p, const uint32_t *vpair, float *ot, int rv, const __m512 *alpha)
{
    __m512i pp[3 * CHUNK / 2];
    const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
    for (int g = 0; g < NG; g++)
        for (int i = 0; i < CHUNK / 2; i++)
            pp[g * CHUNK / 2 + i] =
                _mm512_or_si512(_mm512_and_si512(_mm512_castps_si512(p[g * CHUNK + 2 * i + 1]), high),
                                _mm512_srli_epi32(_mm512_castps_si512(p[g * CHUNK + 2 * i]), 16));
    for (int d0 = 0; d0 < D; d0 += 8) {
        __m512 acc[3][8];
        for (int g = 0; g < NG; g++)
            for (int dd = 0; dd < 8; dd++)
                acc[g][dd] = _mm512_mul_ps(_mm512_loadu_ps(ot + (int64_t)(d0 + dd) * rv + 16 * g), alpha[g]);
#pragma GCC unroll 2
        for (int i = 0; i < CHUNK / 2; i++) {
            __m512i pi[3];
            for (int g = 0; g < NG; g++) pi[g] = pp[g * CHUNK / 2 + i];
            for (int dd = 0; dd < 8; dd++) {
                const __m512i vb = _mm512_set1_epi32((int)vpair[i * D + d0 + dd]);
                for (int g = 0; g < NG; g++) acc[g][dd] = DOT(acc[g][dd], pi[g], vb);
            }
        }
        for (int g = 0; g < NG; g++)
            for (int dd = 0; dd < 8; dd++) _mm512_storeu_ps(ot + (int64_t)(d0 + dd) * rv + 16 * g, acc[g][dd]);
    }
}

/* prefill_item's work over a bfloat16 cache with the dot product. scratch:
 * qt2 [D/2][rv] and ot [D][rv] (as prefill_item's qt and ot), then the raw
 * K chunk [16][D] and the V pairs [8][D] (32-bit each). */
static inline __attribute__((always_inline)) DOT_TARGET void DOT_NAME(prefill_item)(
    const int D, float *out, int64_t out_tok, int64_t out_head, const float *q, int64_t q_tok, int64_t q_head,
    const uint16_t *k_cache, const uint16_t *v_cache, const int32_t *table, int block_size, int64_t row_len,
    int count, int pos0, int kv, int G, float scale, float *scratch)
{
    const int rows = count * G, rv = (rows + 15) / 16 * 16, groups = rv / 16;
    uint32_t *qt2 = (uint32_t *)scratch, *kraw = (uint32_t *)(scratch + 2 * (int64_t)D * rv);
    float *ot = scratch + (int64_t)D * rv;
    uint32_t *vpair = kraw + CHUNK * D / 2;
    /* qt2 = the queries rounded to bf16, a row's dim pairs into lanes: 16 rows x
     * 16 pairs at a time as a 32-bit 16 x 16 transpose; padding rows are zeros. */
    for (int g = 0; g < groups; g++) {
        const float *src[16];
        for (int i = 0; i < 16; i++) {
            const int r = g * 16 + i;
            src[i] = r < rows ? q + (int64_t)(r / G) * q_tok + (int64_t)(kv * G + r % G) * q_head : NULL;
        }
        for (int e0 = 0; e0 < D / 2; e0 += 16) {
            __m512 t[16];
            for (int i = 0; i < 16; i++) {
                if (src[i] == NULL) {
                    t[i] = _mm512_setzero_ps();
                    continue;
                }
                const __m256i lo = bf16_round(_mm512_loadu_ps(src[i] + 2 * e0));
                const __m256i hi = bf16_round(_mm512_loadu_ps(src[i] + 2 * e0 + 16));
                t[i] = _mm512_castsi512_ps(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1));
            }
            transpose16(t);
            for (int j = 0; j < 16; j++) _mm512_storeu_ps((float *)qt2 + (int64_t)(e0 + j) * rv + g * 16, t[j]);
        }
    }
    memset(ot, 0, sizeof(float) * (size_t)D * rv);
    __m512 m[MAX_ROWS / 16], l[MAX_ROWS / 16], pos[MAX_ROWS / 16];
    item_positions(rows, groups, count, pos0, G, m, l, pos);
    const int len = pos0 + count;
    const int64_t off = (int64_t)kv * D;
    /* vpair interleaves 32 dims of two V rows as unpacklo/hi_epi16 do, within
     * 128-bit lanes; these put each half back in order of d. */
    const __m512i first = unpack_order(0), second = unpack_order(1);
    int64_t krows[CHUNK];
    for (int k0 = 0; k0 < len; k0 += CHUNK) {
        chunk_rows(krows, table, k0, len, block_size, row_len);
        for (int j = 0; j < CHUNK; j++)
            memcpy(kraw + j * (D / 2), k_cache + krows[j] + off, sizeof(uint16_t) * (size_t)D);
        for (int i = 0; i < CHUNK / 2; i++)
            for (int d = 0; d < D; d += 32) {
                const __m512i a = _mm512_loadu_si512((const void *)(v_cache + krows[2 * i] + off + d));
                const __m512i b = _mm512_loadu_si512((const void *)(v_cache + krows[2 * i + 1] + off + d));
                const __m512i lo = _mm512_unpacklo_epi16(a, b), hi = _mm512_unpackhi_epi16(a, b);
                _mm512_storeu_si512((void *)(vpair + i * D + d), _mm512_permutex2var_epi32(lo, first, hi));
                _mm512_storeu_si512((void *)(vpair + i * D + d + 16), _mm512_permutex2var_epi32(lo, second, hi));
            }
        for (int g0 = 0; g0 < groups; g0 += 3) {
            __m512 scores[3 * CHUNK];
            const int ng = groups - g0 < 3 ? groups - g0 : 3;
            if (ng == 3)
                DOT_NAME(chunk_scores)(D, 3, kraw, qt2 + g0 * 16, rv, scale, scores);
            else if (ng == 2)
                DOT_NAME(chunk_scores)(D, 2, kraw, qt2 + g0 * 16, rv, scale, scores);
            else
                DOT_NAME(chunk_scores)(D, 1, kraw, qt2 + g0 * 16, rv, scale, scores);
            __m512 p[3 * CHUNK], alpha[3];
            for (int g = g0; g < g0 + ng; g++) {
                const int masked = k0 + CHUNK - 1 > pos0 + (g * 16) / G;
                alpha[g - g0] = chunk_softmax(scores + (g - g0) * CHUNK, pos[g], k0, masked, 1, &m[g], &l[g],
                                              p + (g - g0) * CHUNK);
            }
            if (ng == 3)
                DOT_NAME(chunk_pv)(D, 3, p, vpair, ot + g0 * 16, rv, alpha);
            else if (ng == 2)
                DOT_NAME(chunk_pv)(D, 2, p, vpair, ot + g0 * 16, rv, alpha);
            else
                DOT_NAME(chunk_pv)(D, 1, p, vpair, ot + g0 * 16, rv, alpha);
        }
    }
    store_rows(D, out, out_tok, out_head, ot, rv, l, rows, groups, kv, G);
}

static DOT_TARGET void DOT_NAME(item_64)(float *o, int64_t ot, int64_t oh, const float *q, int64_t qt, int64_t qh,
                                         const void *k, const void *v, const int32_t *tb, int bs, int64_t rl, int c,
                                         int p, int kv, int G, float sc, float *s)
{
    DOT_NAME(prefill_item)(64, o, ot, oh, q, qt, qh, k, v, tb, bs, rl, c, p, kv, G, sc, s);
}

static DOT_TARGET void DOT_NAME(item_128)(float *o, int64_t ot, int64_t oh, const float *q, int64_t qt, int64_t qh,
                                          const void *k, const void *v, const int32_t *tb, int bs, int64_t rl, int c,
                                          int p, int kv, int G, float sc, float *s)
{
    DOT_NAME(prefill_item)(128, o, ot, oh, q, qt, qh, k, v, tb, bs, rl, c, p, kv, G, sc, s);
}
