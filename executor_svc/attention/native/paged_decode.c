/* Paged decode attention for CPUs, reading K/V in place from the block cache.
 *
 * PyTorch cannot index the paged cache without first gathering every
 * request's K/V rows into a contiguous copy; on a memory-bound decode that
 * copy (write + read back) triples the bytes moved. This kernel walks each
 * request's block table and reads every cached K and V row exactly once.
 *
 * Layout (per layer): cache[num_blocks][block_size][num_kv_heads][head_dim],
 * float32 or bfloat16; or, with KV_INT8, [..][num_kv_heads][head_dim + 4]
 * bytes: each head's row is head_dim int8 values and their float32 scale
 * (executor_svc/kv_quant.py: value = int8 x scale). Token t of request r
 * lives in block block_tables[r][t / block_size] at row t % block_size.
 *
 * Decode i reads query row tokens[i], request row seq_index[i] of the block
 * tables and seq_lens, and writes output row out_rows[i].
 *
 * `bf16` says which operands are bfloat16 (else float32), one bit each:
 * BF16_KV the caches, BF16_Q the queries, BF16_OUT the output. bfloat16
 * queries are widened as read, and outputs rounded as written (to nearest,
 * ties to even, NaN -> 0x7FC0: torch's .to(torch.bfloat16) of the float32
 * result, bit for bit), so that a bfloat16 model needs no float32 copies of
 * either around the call. Over a bfloat16 cache, BF16_DOT multiplies with
 * VDPBF16PS instead of widening (decode_dot.h: queries and probabilities
 * rounded to bf16), and BF16_DOT_EMULATED does the same arithmetic in
 * AVX-512F; either returns -2 where that path is missing (a build without
 * -DPAGED_DECODE_DOT or AVX-512BW, no instance for the shape, or BF16_DOT
 * on a CPU without AVX512-BF16: paged_decode_dot_native() says).
 *
 * Two implementations behind one entry point:
 *  - AVX-512 (head_dim 64 or 128, up to 8 query heads per KV head): work item
 *    = (decode, all its KV heads), or (decode, KV head) when there are too
 *    few decodes to share out; one pass over the history with an online
 *    softmax, 16 tokens at a time, accumulators in registers (decode_heads).
 *  - portable C (any other shape or CPU; -DPAGED_DECODE_GENERIC forces it, so
 *    tests can check it on AVX-512 machines too): work item = one decode, all
 *    heads; each token's K/V row is loaded once and serves every query head
 *    (GQA), in two passes: scores = q.K with an exact softmax, then out = p.V.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_HEADS 256
#define BF16_KV 1
#define BF16_Q 2
#define BF16_OUT 4
#define BF16_DOT 8
#define BF16_DOT_EMULATED 16
#define KV_INT8 32 /* the caches hold int8 rows with a float32 scale each (not with the other bits) */
#define INT8_SCALE_BYTES 4 /* kv_quant.SCALE_BYTES */
#include "../../native/hadamard.h"

static inline float widen_bf16(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Round to nearest, ties to even, as torch's c10::BFloat16 (and bf16.h). */
static inline uint16_t round_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u)
        return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static inline float load_value(const void *base, int64_t i, int bf16) {
    return bf16 ? widen_bf16(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

static inline void store_value(void *base, int64_t i, float v, int bf16) {
    if (bf16)
        ((uint16_t *)base)[i] = round_bf16(v);
    else
        ((float *)base)[i] = v;
}

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

/* Token `slot`'s row of every KV head from an int8 cache (KV_INT8),
 * dequantized into `scratch` [num_kv_heads][head_dim]. */
static inline const float *int8_token_row(float *scratch, const void *cache, int64_t slot, int num_kv_heads,
                                          int head_dim) {
    const int64_t stride = head_dim + INT8_SCALE_BYTES;
    const int8_t *src = (const int8_t *)cache + slot * num_kv_heads * stride;
    for (int h = 0; h < num_kv_heads; h++, src += stride) {
        float s;
        memcpy(&s, src + head_dim, sizeof s);
        for (int d = 0; d < head_dim; d++) scratch[h * head_dim + d] = (float)src[d] * s;
    }
    return scratch;
}

static int decode_generic(
    void *out, int64_t out_tok_stride, int64_t out_head_stride,
    const void *q, int64_t q_tok_stride, int64_t q_head_stride,
    const void *k_cache, const void *v_cache, int bf16,
    const int32_t *block_tables, int64_t block_table_stride,
    const int32_t *seq_lens, const int64_t *tokens, const int64_t *out_rows, const int32_t *seq_index,
    int num_decodes,
    int num_heads, int num_kv_heads, int head_dim, int block_size, int max_seq_len,
    float scale, int num_threads)
{
    const int group = num_heads / num_kv_heads;
    const int cache_bf16 = (bf16 & BF16_KV) != 0, q_bf16 = (bf16 & BF16_Q) != 0, out_bf16 = (bf16 & BF16_OUT) != 0;
    const int cache_int8 = (bf16 & KV_INT8) != 0;
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
                    const int64_t src = tokens[i] * q_tok_stride + (int64_t)h * q_head_stride;
                    for (int d = 0; d < head_dim; d++) qv[h * head_dim + d] = load_value(q, src + d, q_bf16) * scale;
                    if (cache_int8 && is_power_of_two(head_dim))  /* to meet the keys, stored rotated */
                        fwht_normalized(qv + h * head_dim, head_dim);
                }
                float maxs[MAX_HEADS], sums[MAX_HEADS];
                for (int h = 0; h < num_heads; h++) maxs[h] = -INFINITY;
                /* Pass 1: every head's score against each cached key, token by token.
                 * A token's K row (all KV heads) is contiguous, and a block's
                 * tokens are contiguous: the reads stream. */
                for (int t = 0; t < len; t++) {
                    const int64_t slot = (int64_t)table[t / block_size] * block_size + t % block_size;
                    const float *krow = cache_int8 ? int8_token_row(row, k_cache, slot, num_kv_heads, head_dim)
                                                 : token_row(row, k_cache, slot * row_len, row_len, cache_bf16);
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
                    const float *vrow = cache_int8 ? int8_token_row(row, v_cache, slot, num_kv_heads, head_dim)
                                                 : token_row(row, v_cache, slot * row_len, row_len, cache_bf16);
                    for (int h = 0; h < num_heads; h++) {
                        const float p = scores[(size_t)h * max_seq_len + t];
                        const float *vh = vrow + (h / group) * head_dim;
                        float *ah = acc + h * head_dim;
#pragma omp simd
                        for (int d = 0; d < head_dim; d++) ah[d] += p * vh[d];
                    }
                }
                for (int h = 0; h < num_heads; h++) {
                    const int64_t dst = out_rows[i] * out_tok_stride + (int64_t)h * out_head_stride;
                    const float inv = 1.f / sums[h];
                    for (int d = 0; d < head_dim; d++) store_value(out, dst + d, acc[h * head_dim + d] * inv, out_bf16);
                }
            }
            free(scores);
        }
    }
    return failed ? -1 : 0;
}

#if defined(__AVX512F__) && !defined(PAGED_DECODE_GENERIC)
#include <immintrin.h>

#include "../../native/exp512.h"

#define MAX_ITEM_HEADS 64 /* query heads one work item may cover */
#define CHUNK 16 /* tokens scored together: one zmm of scores per head */
#include "chunk_rows.h"

/* 16 consecutive values of a K/V row, widened to float32. */
static inline __m512 load16(const void *base, int64_t first, int bf16) {
    if (!bf16)
        return _mm512_loadu_ps((const float *)base + first);
    const __m256i raw = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + first));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

/* Sums each of 16 vectors: out[j] = sum of v[j]'s lanes. A tree of 128- and
 * 32-bit lane shuffles halves the vector count at each level (45 ops instead
 * of 16 separate horizontal sums); the last permute restores token order. */
static inline __m512 sum16(__m512 v[16]) {
    __m512 w[8], u[4], z[2];
    for (int k = 0; k < 8; k++)
        w[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[k], v[k + 8], 0x44), _mm512_shuffle_f32x4(v[k], v[k + 8], 0xEE));
    for (int k = 0; k < 4; k++)
        u[k] = _mm512_add_ps(_mm512_shuffle_f32x4(w[k], w[k + 4], 0x88), _mm512_shuffle_f32x4(w[k], w[k + 4], 0xDD));
    for (int k = 0; k < 2; k++)
        z[k] = _mm512_add_ps(_mm512_shuffle_ps(u[k], u[k + 2], 0x44), _mm512_shuffle_ps(u[k], u[k + 2], 0xEE));
    const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], 0x88), _mm512_shuffle_ps(z[0], z[1], 0xDD));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15), r);
}

/* The online softmax's running max m of one query head, kept lazily (the
 * dot path, decode_dot.h): the lane-wise sums l and the accumulators
 * acc[0 .. NC-1] are rescaled by e^(m - m') only when a score of the chunk,
 * s, exceeds m by more than RESCALE_SLACK, and m' is the largest of those
 * scores. Until then the probabilities e^(s - m) may exceed 1, by at most
 * e^8, which float32 sums and bf16's relative rounding hold as well as
 * values <= 1: softmax does not depend on the shift. Most chunks then skip
 * a horizontal max and an exp, two steps of each head's dependent chain. On
 * the first chunk m = -inf, so any score above -inf sets it. A NaN score
 * (a NaN query or key) never becomes m, which would stop every later
 * rescale; it makes l NaN instead, so the head's output is NaN, as exact
 * attention's would be. */
#define RESCALE_SLACK 8.0f
static inline __attribute__((always_inline)) void lazy_rescale(__m512 s, float *m, __m512 *l, __m512 *acc, int NC)
{
    /* Not (s <= m + slack): above it, or NaN; one compare on the common path. */
    __mmask16 above = _mm512_cmp_ps_mask(s, _mm512_set1_ps(*m + RESCALE_SLACK), _CMP_NLE_UQ);
    if (!above)
        return;
    const __mmask16 nan = _mm512_cmp_ps_mask(s, s, _CMP_UNORD_Q);
    if (nan) {
        *l = _mm512_set1_ps(NAN);
        above &= (__mmask16)~nan;
        if (!above)
            return;
    }
    const float m_new = _mm512_mask_reduce_max_ps(above, s);
    const __m512 alpha = exp512(_mm512_set1_ps(*m - m_new));
    *l = _mm512_mul_ps(*l, alpha);
    for (int c = 0; c < NC; c++) acc[c] = _mm512_mul_ps(acc[c], alpha);
    *m = m_new;
}

/* One decode's attention for the query heads of KV heads kv_first ..
 * kv_first + kv_count - 1 (G per KV head), in one pass over its history with
 * an online softmax (running max m, sum l):
 *
 *   per chunk of 16 tokens:  s = q.K  ->  m' = max(m, max s),  p = e^(s - m')
 *                            acc = acc * e^(m - m') + p.V,  l = l * e^(m - m') + sum p
 *   out = acc / l
 *
 * G and NC (= head_dim / 16) are compile-time constants in each instance, so
 * one KV head's accumulators stay in registers. Within a chunk the KV heads
 * are visited in turn, so each token's K and V rows are read whole, front to
 * back. A chunk's 16 rows may span blocks: rows[] holds each token's row
 * offset, resolved through the block table. */
static inline __attribute__((always_inline)) void decode_heads(
    const int G, const int NC, const int bf16, float *out, int64_t out_head_stride, const float *q, int64_t q_head_stride,
    const void *k_cache, const void *v_cache, const int32_t *table, int len, int block_size,
    int64_t row_len, int kv_first, int kv_count, float scale)
{
    /* Query head hh = kv * G + h of this item (kv counted from kv_first). The
     * accumulators of the KV head being processed live in registers; between
     * KV heads they wait in acc_mem (L1). */
    float qs[MAX_ITEM_HEADS][128], p[8][CHUNK], m[MAX_ITEM_HEADS], l[MAX_ITEM_HEADS];
    __m512 acc_mem[MAX_ITEM_HEADS][8];
    /* A NaN score (a NaN query or key) may or may not come out of a chunk's
     * horizontal max below, but exp512 keeps it NaN, so its weight makes l
     * and the accumulators NaN: the head's output is NaN, as exact
     * attention's is, with no check in the chunk's dependent chain. */
    for (int hh = 0; hh < kv_count * G; hh++) {
        const float *src = q + (int64_t)(kv_first * G + hh) * q_head_stride;
        for (int d = 0; d < NC * 16; d++) qs[hh][d] = src[d] * scale;
        for (int c = 0; c < NC; c++) acc_mem[hh][c] = _mm512_setzero_ps();
        m[hh] = -INFINITY;
        l[hh] = 0.f;
    }
    const int esz = bf16 ? 2 : 4;
    const int64_t first_off = (int64_t)kv_first * NC * 16;
    int64_t rows_a[CHUNK], rows_b[CHUNK], rows_c[CHUNK], *rows = rows_a, *next = rows_b, *far = rows_c;
    chunk_rows(rows, table, 0, len, block_size, row_len);
    int n_next = CHUNK < len ? chunk_rows(next, table, CHUNK, len, block_size, row_len) : 0;
    for (int t0 = 0; t0 < len; t0 += CHUNK) {
        const int n = len - t0 < CHUNK ? len - t0 : CHUNK;
        const __mmask16 valid = (__mmask16)((1u << n) - 1);
        /* Later chunks' rows are in other blocks, which the hardware
         * prefetcher cannot predict, so they are prefetched in two stages,
         * spread over this chunk's V pass (token j's slice of the current KV
         * head with token j's V rows, below): the chunk after next from DRAM
         * into L2 (T1), the next one from L2 into L1 (T0). Issuing them all
         * at the chunk's start filled the line-fill buffers and stalled the
         * arithmetic behind them (spreading them: 1.12x over 30 cold layers
         * on a Xeon). With the next chunk alone prefetched straight into L1,
         * an AMD EPYC with AVX512-BF16 read 9-12 GB/s: each T0 prefetch held
         * an L1 miss buffer for a whole DRAM latency. The L2 stage made it
         * 1.7x faster there (docs/optimization_log.md). */
        const int n_far = t0 + 2 * CHUNK < len ? chunk_rows(far, table, t0 + 2 * CHUNK, len, block_size, row_len) : 0;
        for (int kv = 0; kv < kv_count; kv++) {
            const int64_t off = first_off + (int64_t)kv * NC * 16;
            __m512 acc[8][8];
#pragma GCC unroll 8
            for (int h = 0; h < G; h++)
#pragma GCC unroll 8
                for (int c = 0; c < NC; c++) acc[h][c] = acc_mem[kv * G + h][c];
#pragma GCC unroll 8
            for (int h = 0; h < G; h++) {
                const int hh = kv * G + h;
                __m512 part[CHUNK];
#pragma GCC unroll 16
                for (int j = 0; j < CHUNK; j++) part[j] = _mm512_setzero_ps();
#pragma GCC unroll 8
                for (int c = 0; c < NC; c++) {
                    const __m512 qc = _mm512_loadu_ps(qs[hh] + 16 * c);
#pragma GCC unroll 16
                    for (int j = 0; j < CHUNK; j++)
                        part[j] = _mm512_fmadd_ps(qc, load16(k_cache, rows[j] + off + 16 * c, bf16), part[j]);
                }
                const __m512 s = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid, sum16(part));
                const float s_max = _mm512_reduce_max_ps(s), m_new = s_max > m[hh] ? s_max : m[hh];
                const __m512 e = _mm512_maskz_mov_ps(valid, exp512(_mm512_sub_ps(s, _mm512_set1_ps(m_new))));
                /* The vector exp, not expf: a libm call would spill every accumulator.
                 * On the first chunk m = -inf and alpha ~ 1e-38 scales zeros. */
                const __m512 alpha = exp512(_mm512_set1_ps(m[hh] - m_new));
                l[hh] = l[hh] * _mm512_cvtss_f32(alpha) + _mm512_reduce_add_ps(e);
                m[hh] = m_new;
                _mm512_storeu_ps(p[h], e);
#pragma GCC unroll 8
                for (int c = 0; c < NC; c++) acc[h][c] = _mm512_mul_ps(acc[h][c], alpha);
            }
            for (int j = 0; j < n; j++) {
                prefetch_token(k_cache, v_cache, far, n_far, next, n_next, j, off, esz, NC * 16 * esz);
#pragma GCC unroll 8
                for (int c = 0; c < NC; c++) {
                    const __m512 v = load16(v_cache, rows[j] + off + 16 * c, bf16);
#pragma GCC unroll 8
                    for (int h = 0; h < G; h++) acc[h][c] = _mm512_fmadd_ps(_mm512_set1_ps(p[h][j]), v, acc[h][c]);
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
    for (int hh = 0; hh < kv_count * G; hh++) {
        const __m512 inv = _mm512_set1_ps(1.f / l[hh]);
        float *dst = out + (int64_t)(kv_first * G + hh) * out_head_stride;
        for (int c = 0; c < NC; c++) _mm512_storeu_ps(dst + 16 * c, _mm512_mul_ps(acc_mem[hh][c], inv));
    }
}

/* One instance per (heads per KV head, head_dim / 16, bfloat16 cache) the fast path serves. */
#define DECODE_INSTANCE(G, NC, BF)                                                                          \
    static void decode_##G##_##NC##_##BF(float *o, int64_t os, const float *q, int64_t qs, const void *k,  \
                                         const void *v, const int32_t *t, int len, int bs, int64_t rl,     \
                                         int kv, int nkv, float sc) {                                      \
        decode_heads(G, NC, BF, o, os, q, qs, k, v, t, len, bs, rl, kv, nkv, sc);                          \
    }
#define DECODE_INSTANCES(G) \
    DECODE_INSTANCE(G, 4, 0) DECODE_INSTANCE(G, 8, 0) DECODE_INSTANCE(G, 4, 1) DECODE_INSTANCE(G, 8, 1)
DECODE_INSTANCES(1) DECODE_INSTANCES(2) DECODE_INSTANCES(3) DECODE_INSTANCES(4)
DECODE_INSTANCES(5) DECODE_INSTANCES(6) DECODE_INSTANCES(7) DECODE_INSTANCES(8)

typedef void (*decode_fn)(float *, int64_t, const float *, int64_t, const void *, const void *,
                          const int32_t *, int, int, int64_t, int, int, float);
#define GROUP(G) {{decode_##G##_4_0, decode_##G##_4_1}, {decode_##G##_8_0, decode_##G##_8_1}}
static const decode_fn DECODE_FNS[8][2][2] = {GROUP(1), GROUP(2), GROUP(3), GROUP(4),
                                              GROUP(5), GROUP(6), GROUP(7), GROUP(8)};

/* The int8 cache's instances (decode_int8.h): its integer dot products need
 * AVX-512BW, which every AVX-512 server CPU but the first Xeon Phis has. */
#ifdef __AVX512BW__
#define HAVE_INT8 1
#include "decode_int8.h"
#endif

/* The bf16 dot-product instances (decode_dot.h), in the build made with
 * -DPAGED_DECODE_DOT only (they double the compile time, and only the "dot"
 * decode route uses them): emulated, and with VDPBF16PS where the compiler
 * builds it (HAVE_NATIVE_DOT, bf16_dot.h). Their V interleave needs
 * AVX-512BW, which every CPU with AVX512-BF16 has. */
#if defined(__AVX512BW__) && defined(PAGED_DECODE_DOT)
#define HAVE_DOT 1
#include "../../native/bf16.h"
#include "../../native/bf16_dot.h"
#define DOT_NAME(x) x##_dot_emulated
#define DOT_TARGET
#define DOT(acc, a, b) dot_emulated(acc, a, b)
#include "decode_dot.h"
#undef DOT_NAME
#undef DOT_TARGET
#undef DOT
#ifdef HAVE_NATIVE_DOT
#define DOT_NAME(x) x##_dot_native
#define DOT_TARGET DOT_NATIVE_TARGET
#define DOT(acc, a, b) DOT_NATIVE_OP(acc, a, b)
#include "decode_dot.h"
#undef DOT_NAME
#undef DOT_TARGET
#undef DOT
#endif
#endif

/* The fast path's function for this shape and `bf16` bits, or NULL. */
static decode_fn fast_path(int group, int head_dim, int bf16) {
    if (group < 1 || group > 8 || (head_dim != 64 && head_dim != 128))
        return NULL;
    const int wide = head_dim == 128;
    if (bf16 & KV_INT8) {
#ifdef HAVE_INT8
        return bf16 & (BF16_KV | BF16_DOT | BF16_DOT_EMULATED) ? NULL : DECODE_FNS_int8[group - 1][wide];
#else
        return NULL;
#endif
    }
    if (!(bf16 & (BF16_DOT | BF16_DOT_EMULATED)))
        return DECODE_FNS[group - 1][wide][(bf16 & BF16_KV) != 0];
    if (!(bf16 & BF16_KV))
        return NULL;
#ifdef HAVE_NATIVE_DOT
    if (bf16 & BF16_DOT)
        return __builtin_cpu_supports("avx512bf16") ? DECODE_FNS_dot_native[group - 1][wide] : NULL;
#endif
#ifdef HAVE_DOT
    if (bf16 & BF16_DOT_EMULATED)
        return DECODE_FNS_dot_emulated[group - 1][wide];
#endif
    return NULL;
}

#endif /* AVX-512 */

/* 1 where this build has the bf16 dot instances (native or emulated) for
 * head_dim 64/128 and up to 8 query heads per KV head. */
int paged_decode_dot_built(void)
{
#ifdef HAVE_DOT
    return 1;
#else
    return 0;
#endif
}

/* 1 where this build has the VDPBF16PS decode path and this CPU runs it. */
int paged_decode_dot_native(void)
{
#ifdef HAVE_NATIVE_DOT
    return __builtin_cpu_supports("avx512bf16") ? 1 : 0;
#else
    return 0;
#endif
}

int paged_decode_attention(
    void *out, int64_t out_tok_stride, int64_t out_head_stride,
    const void *q, int64_t q_tok_stride, int64_t q_head_stride,
    const void *k_cache, const void *v_cache, int bf16,
    const int32_t *block_tables, int64_t block_table_stride,
    const int32_t *seq_lens, const int64_t *tokens, const int64_t *out_rows, const int32_t *seq_index,
    int num_decodes,
    int num_heads, int num_kv_heads, int head_dim, int block_size, int max_seq_len,
    float scale, int num_threads)
{
#if defined(__AVX512F__) && !defined(PAGED_DECODE_GENERIC)
    const decode_fn fn = fast_path(num_heads / num_kv_heads, head_dim, bf16);
    if (fn != NULL) {
        const int64_t head_len = bf16 & KV_INT8 ? head_dim + INT8_SCALE_BYTES : head_dim, row_len = num_kv_heads * head_len;
        const int esz = bf16 & KV_INT8 ? 1 : bf16 & BF16_KV ? 2 : 4;
        /* Work item = (decode, all its KV heads) when there are enough decodes
         * to share out: each token's row is then read whole, front to back,
         * which the hardware prefetcher streams. Few decodes: (decode, KV
         * head), so that a single long decode still uses every thread. */
        const int per_item = num_decodes >= 2 * num_threads && num_heads <= MAX_ITEM_HEADS ? num_kv_heads : 1;
        const int items_per_decode = num_kv_heads / per_item, group = num_heads / num_kv_heads;
        /* bfloat16 queries or outputs: the item's heads are staged in float32
         * per thread (a few KB, beside a whole history of K/V reads). */
        const int q_bf16 = (bf16 & BF16_Q) != 0, out_bf16 = (bf16 & BF16_OUT) != 0, staged = q_bf16 || out_bf16;
        const int64_t num_items = (int64_t)num_decodes * items_per_decode;
        int failed = 0;
        int64_t next_item = 0; /* items are claimed in order (below) */
        const int ahead = num_items >= 4 * (int64_t)num_threads;
#pragma omp parallel num_threads(num_threads)
        {
            float *stage = staged ? malloc(2 * sizeof(float) * (size_t)num_heads * head_dim) : NULL;
            if (staged && stage == NULL) {
#pragma omp atomic write
                failed = 1;
            }
            /* Dynamic scheduling, one item at a time. With many items each
             * thread claims its next one before running the current one and
             * prefetches that item's first chunk: the kernel prefetches an
             * item's later chunks while it scores earlier ones, but its first
             * would otherwise be read cold, a DRAM latency per item with
             * nothing to overlap it (docs/optimization_log.md). With few
             * (long) items a claim held ahead could leave a thread idle. */
            int64_t claimed = -1;
            for (int64_t item = __atomic_fetch_add(&next_item, 1, __ATOMIC_RELAXED); item < num_items;
                 item = ahead ? claimed : __atomic_fetch_add(&next_item, 1, __ATOMIC_RELAXED)) {
                if (ahead && (claimed = __atomic_fetch_add(&next_item, 1, __ATOMIC_RELAXED)) < num_items) {
                    /* its first chunk into L2 (prefetch_token's T1 stage), all of the item's KV heads */
                    const int r = seq_index[claimed / items_per_decode];
                    const int64_t off = (claimed % items_per_decode) * per_item * head_len;
                    int64_t first[CHUNK];
                    const int n = chunk_rows(first, block_tables + (int64_t)r * block_table_stride, 0, seq_lens[r],
                                             block_size, row_len);
                    for (int j = 0; j < n; j++)
                        prefetch_token(k_cache, v_cache, first, n, NULL, 0, j, off, esz, (int)(per_item * head_len * esz));
                }
                if (staged && stage == NULL)
                    continue;
                const int i = (int)(item / items_per_decode), kv = (int)(item % items_per_decode) * per_item;
                const int r = seq_index[i], h0 = kv * group, h1 = (kv + per_item) * group;
                const float *qrow = (const float *)q + tokens[i] * q_tok_stride;
                float *orow = (float *)out + out_rows[i] * out_tok_stride;
                int64_t qhs = q_head_stride, ohs = out_head_stride;
                if (q_bf16) {
                    const uint16_t *src = (const uint16_t *)q + tokens[i] * q_tok_stride;
                    for (int h = h0; h < h1; h++)
                        for (int d = 0; d < head_dim; d++)
                            stage[h * head_dim + d] = widen_bf16(src[(int64_t)h * q_head_stride + d]);
                    qrow = stage;
                    qhs = head_dim;
                }
                if (out_bf16) {
                    orow = stage + (size_t)num_heads * head_dim;
                    ohs = head_dim;
                }
                fn(orow, ohs, qrow, qhs, k_cache, v_cache, block_tables + (int64_t)r * block_table_stride, seq_lens[r],
                   block_size, row_len, kv, per_item, scale);
                if (out_bf16) {
                    uint16_t *dst = (uint16_t *)out + out_rows[i] * out_tok_stride;
                    for (int h = h0; h < h1; h++)
                        for (int d = 0; d < head_dim; d++)
                            dst[(int64_t)h * out_head_stride + d] = round_bf16(orow[h * head_dim + d]);
                }
            }
            free(stage);
        }
        return failed ? -1 : 0;
    }
#endif
    if (bf16 & (BF16_DOT | BF16_DOT_EMULATED))
        return -2; /* the dot arithmetic was asked for where it has no path */
    /* No AVX-512, or a shape the fast path has no instance for. */
    return decode_generic(out, out_tok_stride, out_head_stride, q, q_tok_stride, q_head_stride, k_cache, v_cache,
                          bf16, block_tables, block_table_stride, seq_lens, tokens, out_rows, seq_index,
                          num_decodes, num_heads, num_kv_heads, head_dim, block_size, max_seq_len, scale,
                          num_threads);
}
