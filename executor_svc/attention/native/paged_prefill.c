/* Paged prefill attention for CPUs with AVX-512, reading K/V in place from
 * the block cache (same layout as paged_decode.c:
 * cache[num_blocks][block_size][num_kv_heads][head_dim], float32 or bfloat16).
 *
 * A prefill (or a chunk of one) has many query tokens, each attending
 * causally to the request's positions 0 .. its own. SDPA needs every
 * request's K/V gathered into a copy and runs this shape at ~45 GFLOP/s
 * here; this kernel reads the cache in place and keeps both matrix products
 * in FMA form.
 *
 * Work item = (QB consecutive query tokens of one request, one KV head). Its
 * R = tokens x G query rows (G query heads per KV head; row r = token
 * r / G, head r % G) are padded to whole vectors and laid out with rows in
 * vector lanes, so that everything per row is vertical arithmetic:
 *
 *     qt[d][r]   = q[r][d] * scale       S[j][r] = sum_d K[j][d] * qt[d][r]
 *     m[r], l[r]: running max and sum    ot[d][r] += sum_j p[j][r] * V[j][d]
 *
 * For each 16-key chunk and each group of 16 rows, S is 16 vectors (one per
 * key) built from broadcasts of the key's row, up to three groups sharing
 * each broadcast (chunk_scores); the online softmax takes the row max
 * across those vectors (no horizontal reductions); p times V is again
 * broadcasts of V's row into FMAs, each broadcast shared by the same groups
 * (chunk_pv). Keys past a row's position are masked, which only the chunks
 * crossing the diagonal need. The queries go into lanes, and the outputs
 * back into rows, as 16 x 16 register transposes.
 *
 * Over a bfloat16 cache, the bits PREFILL_DOT / PREFILL_DOT_EMULATED of
 * `cache_bf16` run both products as bf16 dot products instead (prefill_dot.h:
 * queries and probabilities rounded to bf16).
 *
 * Returns 0; -1 if this build has no AVX-512 path or the shape has no
 * instance (the caller then keeps SDPA); -2 if scratch allocation failed;
 * -3 if an item has no tokens or more than QB (nothing is written then);
 * -4 if the dot product was asked for where this build or CPU has none.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QB 16 /* query tokens per work item */
/* paged_prefill_attention's `cache_bf16` bits: a bfloat16 cache, and over it
 * the bf16 dot product (VDPBF16PS, or its emulation) instead of widening. */
#define PREFILL_BF16 1
#define PREFILL_DOT 2
#define PREFILL_DOT_EMULATED 4
/* An int8 cache (--kv-cache-dtype int8): rows of head_dim int8 values and a
 * float32 scale per KV head (kv_quant.py), dequantized per chunk as bfloat16
 * rows are widened; not with the other bits. */
#define PREFILL_INT8 8
#define INT8_SCALE_BYTES 4 /* kv_quant.SCALE_BYTES */
#include "../../native/hadamard.h"
#define MAX_G 8 /* query heads per KV head */
#define MAX_ROWS (QB * MAX_G)

int paged_prefill_tokens_per_item(void) { return QB; }

#if defined(__AVX512F__)
#include <immintrin.h>

#include "../../native/bf16.h"
#include "../../native/exp512.h"

#define CHUNK 16
#include "chunk_rows.h"

/* r[i][j] -> r[j][i] for a 16 x 16 float32 tile held in 16 registers. */
static inline __attribute__((always_inline)) void transpose16(__m512 r[16]) {
    __m512 t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 2]);
        const __m512d c = _mm512_castps_pd(t[4 * i + 1]), d = _mm512_castps_pd(t[4 * i + 3]);
        u[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
        u[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
        u[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
        u[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
    }
    for (int c = 0; c < 4; c++) {
        const __m512 v = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x44), w = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xEE);
        const __m512 v2 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x44), w2 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xEE);
        r[c] = _mm512_shuffle_f32x4(v, v2, 0x88);
        r[c + 4] = _mm512_shuffle_f32x4(v, v2, 0xDD);
        r[c + 8] = _mm512_shuffle_f32x4(w, w2, 0x88);
        r[c + 12] = _mm512_shuffle_f32x4(w, w2, 0xDD);
    }
}
/* S of one 16-key chunk for NG (1-3) groups of 16 query rows, into
 * scores[g * CHUNK + j]: S[j][r] = sum_d K[j][d] * qt[d][r], d in order, one
 * FMA per d. Keys go 8 at a time, so that NG x 8 sums, NG query vectors and
 * a broadcast key value fit the 32 vector registers: each broadcast then
 * feeds NG FMAs instead of one (the broadcasts were the loop's bottleneck:
 * 17 loads per 16 FMAs with one group at a time). k: the chunk's 16 key
 * rows, ks apart. */
static inline __attribute__((always_inline)) void chunk_scores(const int D, const int NG, const float *k,
                                                               const int64_t ks, const float *qt, int rv,
                                                               __m512 *scores)
{
    for (int h = 0; h < CHUNK; h += 8) {
        __m512 acc[3][8];
        for (int g = 0; g < NG; g++)
            for (int j = 0; j < 8; j++) acc[g][j] = _mm512_setzero_ps();
        for (int d = 0; d < D; d++) {
            __m512 q[3];
            for (int g = 0; g < NG; g++) q[g] = _mm512_loadu_ps(qt + (int64_t)d * rv + 16 * g);
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {
                const __m512 kb = _mm512_set1_ps(k[(h + j) * ks + d]);
                for (int g = 0; g < NG; g++) acc[g][j] = _mm512_fmadd_ps(kb, q[g], acc[g][j]);
            }
        }
        for (int g = 0; g < NG; g++)
            for (int j = 0; j < 8; j++) scores[g * CHUNK + h + j] = acc[g][j];
    }
}

/* The online softmax of one key chunk for one group of 16 query rows (rows
 * in lanes): scores[j] for keys k0 .. k0+15, pos each lane's position,
 * masked if the chunk crosses the diagonal of some lane. Writes the chunk's
 * probabilities p[j] (rounded to bfloat16 with `round`, for the dot kernel;
 * l then sums the rounded values), updates m and l, and returns alpha, the
 * factor that rescales what was accumulated before. */
static inline __attribute__((always_inline)) __m512 chunk_softmax(const __m512 *scores, __m512 pos, int k0,
                                                                  int masked, const int round, __m512 *m, __m512 *l,
                                                                  __m512 *p)
{
    __mmask16 valid[CHUNK];
    /* Four running maxima instead of one chain of 16 dependent max ops; max
     * is exact, so m is the same either way. */
    __m512 mx[4] = {*m, *m, *m, *m};
    for (int j = 0; j < CHUNK; j++) {
        valid[j] = masked ? _mm512_cmp_ps_mask(pos, _mm512_set1_ps((float)(k0 + j)), _CMP_GE_OQ) : (__mmask16)0xFFFF;
        mx[j % 4] = _mm512_mask_max_ps(mx[j % 4], valid[j], mx[j % 4], scores[j]);
    }
    const __m512 m_new = _mm512_max_ps(_mm512_max_ps(mx[0], mx[1]), _mm512_max_ps(mx[2], mx[3]));
    /* m = -inf before the first chunk: alpha = e^-87 then scales zeros. */
    const __m512 alpha = exp512(_mm512_sub_ps(*m, m_new));
    __m512 sum = _mm512_setzero_ps();
    for (int j = 0; j < CHUNK; j++) {
        p[j] = _mm512_maskz_mov_ps(valid[j], exp512(_mm512_sub_ps(scores[j], m_new)));
        if (round)
            p[j] = bf16_rounded(p[j]);
        sum = _mm512_add_ps(sum, p[j]);
    }
    *l = _mm512_fmadd_ps(*l, alpha, sum);
    *m = m_new;
    return alpha;
}

/* p times V for NG (1-3) groups of 16 query rows at once: ot[d] (vectors
 * of group g at ot + 16 g, stride rv) = ot[d] * alpha[g] + sum_j p[g][j] *
 * V[j][d]. Each broadcast of a V value feeds NG FMAs (one group at a time,
 * every FMA needed a broadcast of its own). v: the chunk's 16 rows, vs apart. */
static inline __attribute__((always_inline)) void chunk_pv(const int D, const int NG, const __m512 *p,
                                                           const __m512 *alpha, const float *v, const int64_t vs,
                                                           float *ot, int rv)
{
    for (int d0 = 0; d0 < D; d0 += 8) {
        __m512 acc[3][8];
        for (int g = 0; g < NG; g++)
            for (int dd = 0; dd < 8; dd++)
                acc[g][dd] = _mm512_mul_ps(_mm512_loadu_ps(ot + (int64_t)(d0 + dd) * rv + 16 * g), alpha[g]);
#pragma GCC unroll 4
        for (int j = 0; j < CHUNK; j++) {
            __m512 pj[3];
            for (int g = 0; g < NG; g++) pj[g] = p[g * CHUNK + j];
            for (int dd = 0; dd < 8; dd++) {
                const __m512 vb = _mm512_set1_ps(v[j * vs + d0 + dd]);
                for (int g = 0; g < NG; g++) acc[g][dd] = _mm512_fmadd_ps(vb, pj[g], acc[g][dd]);
            }
        }
        for (int g = 0; g < NG; g++)
            for (int dd = 0; dd < 8; dd++) _mm512_storeu_ps(ot + (int64_t)(d0 + dd) * rv + 16 * g, acc[g][dd]);
    }
}

/* bfloat16 rows widened into a float32 buffer [16][D]. */
static inline void widen_rows(float *dst, const uint16_t *cache, const int64_t *rows, int64_t off, int D)
{
    for (int j = 0; j < CHUNK; j++) {
        const uint16_t *src = cache + rows[j] + off;
        for (int d = 0; d < D; d += 16) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(src + d));
            _mm512_storeu_ps(dst + j * D + d, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16)));
        }
    }
}

/* int8 rows (PREFILL_INT8: head_dim values, then their float32 scale)
 * dequantized into a float32 buffer [16][D]: value = int8 x scale. */
static inline void dequant_rows(float *dst, const int8_t *cache, const int64_t *rows, int64_t off, int D)
{
    for (int j = 0; j < CHUNK; j++) {
        const int8_t *src = cache + rows[j] + off;
        float s;
        memcpy(&s, src + D, sizeof s);
        const __m512 scale = _mm512_set1_ps(s);
        for (int d = 0; d < D; d += 16) {
            const __m512i wide = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(src + d)));
            _mm512_storeu_ps(dst + j * D + d, _mm512_mul_ps(_mm512_cvtepi32_ps(wide), scale));
        }
    }
}

static inline void copy_rows(float *dst, const float *cache, const int64_t *rows, int64_t off, int D)
{
    for (int j = 0; j < CHUNK; j++)
        for (int d = 0; d < D; d += 16)
            _mm512_storeu_ps(dst + j * D + d, _mm512_loadu_ps(cache + rows[j] + off + d));
}

/* An item's running max, sum and lane positions, per group of 16 rows. */
static inline void item_positions(int rows, int groups, int count, int pos0, int G, __m512 *m, __m512 *l, __m512 *pos)
{
    for (int g = 0; g < groups; g++) {
        m[g] = _mm512_set1_ps(-INFINITY);
        l[g] = _mm512_setzero_ps();
        float p[16];
        for (int i = 0; i < 16; i++) {
            const int r = g * 16 + i;
            p[i] = (float)(pos0 + (r < rows ? r / G : count - 1)); /* padding rows copy the last token */
        }
        pos[g] = _mm512_loadu_ps(p);
    }
}

/* out = ot / l, transposed back (lanes into rows) 16 x 16 at a time. */
static inline __attribute__((always_inline)) void store_rows(const int D, float *out, int64_t out_tok,
                                                             int64_t out_head, const float *ot, int rv,
                                                             const __m512 *l, int rows, int groups, int kv, int G)
{
    for (int g = 0; g < groups; g++) {
        const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), l[g]);
        for (int d0 = 0; d0 < D; d0 += 16) {
            __m512 t[16];
            for (int j = 0; j < 16; j++)
                t[j] = _mm512_mul_ps(_mm512_loadu_ps(ot + (int64_t)(d0 + j) * rv + g * 16), inv);
            transpose16(t);
            for (int i = 0; i < 16 && g * 16 + i < rows; i++) {
                const int r = g * 16 + i;
                _mm512_storeu_ps(out + (int64_t)(r / G) * out_tok + (int64_t)(kv * G + r % G) * out_head + d0, t[i]);
            }
        }
    }
}

/* One work item: query tokens first_token .. +count-1 at positions pos0 ..,
 * query heads kv*G .. kv*G+G-1. scratch: qt and ot [D][rv], two [16][D] buffers. */
static inline __attribute__((always_inline)) void prefill_item(
    const int D, float *out, int64_t out_tok, int64_t out_head, const float *q, int64_t q_tok, int64_t q_head,
    const void *k_cache, const void *v_cache, int bf16, const int32_t *table, int block_size, int64_t row_len,
    int count, int pos0, int kv, int G, float scale, float *scratch)
{
    const int rows = count * G, rv = (rows + 15) / 16 * 16, groups = rv / 16;
    float *qt = scratch, *ot = qt + (int64_t)D * rv, *kbuf = ot + (int64_t)D * rv, *vbuf = kbuf + CHUNK * D;
    float *qrot = vbuf + CHUNK * D; /* [rows][D]: an int8 cache's queries, rotated to meet its keys */
    const int int8 = (bf16 & PREFILL_INT8) != 0;
    /* qt = the scaled queries transposed (rows into lanes), 16 x 16 tiles at a
     * time in registers; padding rows are zeros. */
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int g = 0; g < groups; g++) {
        const float *src[16];
        for (int i = 0; i < 16; i++) {
            const int r = g * 16 + i;
            src[i] = r < rows ? q + (int64_t)(r / G) * q_tok + (int64_t)(kv * G + r % G) * q_head : NULL;
            if (int8 && src[i] != NULL) {
                memcpy(qrot + (int64_t)r * D, src[i], sizeof(float) * D);
                fwht_normalized(qrot + (int64_t)r * D, D);
                src[i] = qrot + (int64_t)r * D;
            }
        }
        for (int d0 = 0; d0 < D; d0 += 16) {
            __m512 t[16];
            for (int i = 0; i < 16; i++)
                t[i] = src[i] ? _mm512_mul_ps(_mm512_loadu_ps(src[i] + d0), vscale) : _mm512_setzero_ps();
            transpose16(t);
            for (int j = 0; j < 16; j++)
                _mm512_storeu_ps(qt + (int64_t)(d0 + j) * rv + g * 16, t[j]);
        }
    }
    memset(ot, 0, sizeof(float) * (size_t)D * rv);
    __m512 m[MAX_ROWS / 16], l[MAX_ROWS / 16], pos[MAX_ROWS / 16];
    item_positions(rows, groups, count, pos0, G, m, l, pos);
    const int len = pos0 + count; /* keys 0 .. last query position */
    const int64_t off = (int64_t)kv * (int8 ? D + INT8_SCALE_BYTES : D);
    int64_t krows[CHUNK];
    for (int k0 = 0; k0 < len; k0 += CHUNK) {
        const int n = chunk_rows(krows, table, k0, len, block_size, row_len);
        /* A whole float32 chunk inside one block (k0 is a multiple of 16, so
         * any block size that is one too) is read in place: its rows are
         * row_len apart from one pointer. Other chunks are copied (or
         * widened) into [16][D] buffers, so that the inner loops address
         * every key from one pointer all the same; 16 row pointers measured
         * slower. A partial last chunk is always copied: its rows past len
         * repeat a real one, where the cache's would be unwritten (and
         * 0 x NaN in PV is NaN). */
        const float *kp = kbuf, *vp = vbuf;
        int64_t ks = D;
        if (!bf16 && n == CHUNK && block_size % CHUNK == 0) {
            kp = (const float *)k_cache + krows[0] + off;
            vp = (const float *)v_cache + krows[0] + off;
            ks = row_len;
        } else if (int8) {
            dequant_rows(kbuf, (const int8_t *)k_cache, krows, off, D);
            dequant_rows(vbuf, (const int8_t *)v_cache, krows, off, D);
        } else if (bf16) {
            widen_rows(kbuf, (const uint16_t *)k_cache, krows, off, D);
            widen_rows(vbuf, (const uint16_t *)v_cache, krows, off, D);
        } else {
            copy_rows(kbuf, (const float *)k_cache, krows, off, D);
            copy_rows(vbuf, (const float *)v_cache, krows, off, D);
        }
        for (int g0 = 0; g0 < groups; g0 += 3) {
            __m512 scores[3 * CHUNK];
            const int ng = groups - g0 < 3 ? groups - g0 : 3;
            if (ng == 3)
                chunk_scores(D, 3, kp, ks, qt + g0 * 16, rv, scores);
            else if (ng == 2)
                chunk_scores(D, 2, kp, ks, qt + g0 * 16, rv, scores);
            else
                chunk_scores(D, 1, kp, ks, qt + g0 * 16, rv, scores);
            __m512 probs[3 * CHUNK], alpha[3];
            for (int g = g0; g < g0 + ng; g++) {
                /* Lanes of group g hold positions >= pos0 + (16 g) / G; mask if any key may pass one. */
                const int masked = k0 + CHUNK - 1 > pos0 + (g * 16) / G;
                alpha[g - g0] = chunk_softmax(scores + (g - g0) * CHUNK, pos[g], k0, masked, 0, &m[g], &l[g],
                                              probs + (g - g0) * CHUNK);
            }
            if (ng == 3)
                chunk_pv(D, 3, probs, alpha, vp, ks, ot + g0 * 16, rv);
            else if (ng == 2)
                chunk_pv(D, 2, probs, alpha, vp, ks, ot + g0 * 16, rv);
            else
                chunk_pv(D, 1, probs, alpha, vp, ks, ot + g0 * 16, rv);
        }
    }
    store_rows(D, out, out_tok, out_head, ot, rv, l, rows, groups, kv, G);
}

static void item_64(float *o, int64_t ot, int64_t oh, const float *q, int64_t qt, int64_t qh, const void *k,
                    const void *v, int bf, const int32_t *tb, int bs, int64_t rl, int c, int p, int kv, int G,
                    float sc, float *s)
{
    prefill_item(64, o, ot, oh, q, qt, qh, k, v, bf, tb, bs, rl, c, p, kv, G, sc, s);
}

static void item_128(float *o, int64_t ot, int64_t oh, const float *q, int64_t qt, int64_t qh, const void *k,
                     const void *v, int bf, const int32_t *tb, int bs, int64_t rl, int c, int p, int kv, int G,
                     float sc, float *s)
{
    prefill_item(128, o, ot, oh, q, qt, qh, k, v, bf, tb, bs, rl, c, p, kv, G, sc, s);
}

typedef void (*item_fn)(float *, int64_t, int64_t, const float *, int64_t, int64_t, const void *, const void *,
                        const int32_t *, int, int64_t, int, int, int, int, float, float *);

/* The bf16 dot-product items (prefill_dot.h), emulated and with VDPBF16PS
 * where the compiler builds it (HAVE_NATIVE_DOT, bf16_dot.h). Their V interleave needs
 * AVX-512BW, which every CPU with AVX512-BF16 has. */
#if defined(__AVX512BW__)
#define HAVE_DOT 1
#include "../../native/bf16_dot.h"
#define DOT_NAME(x) x##_dot_emulated
#define DOT_TARGET
#define DOT(acc, a, b) dot_emulated(acc, a, b)
#include "prefill_dot.h"
#undef DOT_NAME
#undef DOT_TARGET
#undef DOT
#ifdef HAVE_NATIVE_DOT
#define DOT_NAME(x) x##_dot_native
#define DOT_TARGET DOT_NATIVE_TARGET
#define DOT(acc, a, b) DOT_NATIVE_OP(acc, a, b)
#include "prefill_dot.h"
#undef DOT_NAME
#undef DOT_TARGET
#undef DOT
#endif
#endif

/* The dot item function for `flags` and head_dim, or NULL where this build or CPU has none. */
static item_fn dot_item(int flags, int head_dim)
{
#ifdef HAVE_NATIVE_DOT
    if (flags & PREFILL_DOT)
        return __builtin_cpu_supports("avx512bf16") ? (head_dim == 64 ? item_64_dot_native : item_128_dot_native)
                                                    : NULL;
#endif
#ifdef HAVE_DOT
    if (flags & PREFILL_DOT_EMULATED)
        return head_dim == 64 ? item_64_dot_emulated : item_128_dot_emulated;
#endif
    (void)flags;
    (void)head_dim;
    return NULL;
}

#endif /* AVX-512 */

/* 1 where this build has the bf16 dot-product items (AVX-512BW). */
int paged_prefill_dot_built(void)
{
#if defined(__AVX512F__) && defined(HAVE_DOT)
    return 1;
#else
    return 0;
#endif
}

/* 1 where this build has the VDPBF16PS items and this CPU runs them. */
int paged_prefill_dot_native(void)
{
#if defined(__AVX512F__) && defined(HAVE_NATIVE_DOT)
    return __builtin_cpu_supports("avx512bf16") ? 1 : 0;
#else
    return 0;
#endif
}

/* Item i: query rows item_token[i] .. + item_count[i] - 1 (<= QB), at
 * positions item_pos[i] .., of the request in block-table row item_seq[i];
 * its K/V (positions 0 .. item_pos[i] + item_count[i] - 1) are in the cache. */
int paged_prefill_attention(
    float *out, int64_t out_tok_stride, int64_t out_head_stride,
    const float *q, int64_t q_tok_stride, int64_t q_head_stride,
    const void *k_cache, const void *v_cache, int cache_bf16,
    const int32_t *block_tables, int64_t block_table_stride,
    const int64_t *item_token, const int32_t *item_count, const int32_t *item_pos, const int32_t *item_seq,
    int num_items, int num_heads, int num_kv_heads, int head_dim, int block_size, float scale, int num_threads)
{
#if defined(__AVX512F__)
    if (num_kv_heads < 1)
        return -1;
    const int G = num_heads / num_kv_heads;
    if (G < 1 || G > MAX_G || G * num_kv_heads != num_heads || (head_dim != 64 && head_dim != 128))
        return -1;
    for (int i = 0; i < num_items; i++)
        if (item_count[i] < 1 || item_count[i] > QB)
            return -3;
    const int dot = cache_bf16 & (PREFILL_DOT | PREFILL_DOT_EMULATED);
    const item_fn dot_fn = dot && (cache_bf16 & PREFILL_BF16) ? dot_item(cache_bf16, head_dim) : NULL;
    if (dot && dot_fn == NULL)
        return -4;
    if ((cache_bf16 & PREFILL_INT8) && (cache_bf16 & ~PREFILL_INT8))
        return -1;
    const int64_t row_len = (int64_t)num_kv_heads * (cache_bf16 & PREFILL_INT8 ? head_dim + INT8_SCALE_BYTES : head_dim);
    const size_t scratch_floats = 3 * (size_t)head_dim * MAX_ROWS + 2 * CHUNK * (size_t)head_dim;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *scratch = aligned_alloc(64, sizeof(float) * scratch_floats);
        if (scratch == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < (int64_t)num_items * num_kv_heads; w++) {
            if (scratch == NULL)
                continue;
            const int i = (int)(w / num_kv_heads), kv = (int)(w % num_kv_heads);
            const int32_t *table = block_tables + (int64_t)item_seq[i] * block_table_stride;
            if (dot_fn != NULL) {
                dot_fn(out + item_token[i] * out_tok_stride, out_tok_stride, out_head_stride,
                       q + item_token[i] * q_tok_stride, q_tok_stride, q_head_stride, k_cache, v_cache, table,
                       block_size, row_len, item_count[i], item_pos[i], kv, G, scale, scratch);
                continue;
            }
            (head_dim == 64 ? item_64 : item_128)(
                out + item_token[i] * out_tok_stride, out_tok_stride, out_head_stride,
                q + item_token[i] * q_tok_stride, q_tok_stride, q_head_stride, k_cache, v_cache, cache_bf16, table,
                block_size, row_len, item_count[i], item_pos[i], kv, G, scale, scratch);
        }
        free(scratch);
    }
    return failed ? -2 : 0;
#else /* no AVX-512: the caller keeps SDPA */
    (void)out; (void)out_tok_stride; (void)out_head_stride; (void)q; (void)q_tok_stride; (void)q_head_stride;
    (void)k_cache; (void)v_cache; (void)cache_bf16; (void)block_tables; (void)block_table_stride;
    (void)item_token; (void)item_count; (void)item_pos; (void)item_seq; (void)num_items; (void)num_heads;
    (void)num_kv_heads; (void)head_dim; (void)block_size; (void)scale; (void)num_threads;
    return -1;
#endif
}
