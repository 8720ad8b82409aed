/* decode_heads (paged_decode.c) over an int8 cache (KV_INT8): per token and
 * KV head, head_dim int8 values and their float32 scale (kv_quant.py).
 *
 * Why not widen each value to float32 as the bfloat16 path does: an int8
 * row is half the bytes of a bf16 one, so per byte read the widening path's
 * instructions double, and on an AMD EPYC with AVX512-BF16 it was compute
 * bound at ~16 GB/s, 1.2x faster than bf16 instead of ~2x
 * (docs/optimization_log.md). Here:
 *
 *   Q.K  integer dot products: each query head is rotated as the keys were
 *        stored (kv_quant.py: the normalized Walsh-Hadamard transform,
 *        hadamard.h; head_dim 64 and 128 are powers of two) and rounded once
 *        per decode to int16 (q16 = round(q x 32767 / max|q|), an error of 1/65534 of
 *        max|q|, far below the keys' own quantization error), each 32-byte
 *        line of a key row is sign-extended to 32 int16 (one VPMOVSXBW)
 *        and multiplied in pairs into int32 lanes (VPDPWSSD with
 *        AVX512-VNNI, else VPMADDWD + VPADDD), exactly; the sums are
 *        scaled by the key's and the query's scales once per chunk.
 *   P.V  each V value is widened to float32 (VPMOVSXBD, VCVTDQ2PS) and
 *        multiplied by G probabilities that carry the V row's scale.
 *   max  kept lazily (lazy_rescale), l lane-wise, as decode_dot.h does, and
 *        in the same two passes: every KV head's scores, then their P.V.
 *
 * Overflow: |q16 x k| <= 32767 x 127 per product, 128 products per lane
 * pair sum at most (head_dim 128): < 2^30.
 */

#ifdef __AVX512VNNI__
#define DOT_I16(acc, a, b) _mm512_dpwssd_epi32(acc, a, b)
#else
#define DOT_I16(acc, a, b) _mm512_add_epi32(acc, _mm512_madd_epi16(a, b))
#endif

static inline __attribute__((always_inline)) void decode_int8_heads(
    const int G, const int NC, float *out, int64_t out_head_stride, const float *q, int64_t q_head_stride,
    const void *k_cache, const void *v_cache, const int32_t *table, int len, int block_size, int64_t row_len,
    int kv_first, int kv_count, float scale)
{
    const int D = NC * 16, NW = D / 32, head_len = D + INT8_SCALE_BYTES;
    int16_t qw[MAX_ITEM_HEADS][128] __attribute__((aligned(64)));
    float qscale[MAX_ITEM_HEADS], m[MAX_ITEM_HEADS], pb[MAX_ITEM_HEADS][CHUNK] __attribute__((aligned(64)));
    __m512 l[MAX_ITEM_HEADS]; /* lane-wise running sums, added up once at the end */
    __m512 acc_mem[MAX_ITEM_HEADS][8];
    for (int hh = 0; hh < kv_count * G; hh++) {
        /* Rotated to meet the rotated keys (kv_quant.py, hadamard.h). */
        const float *src = q + (int64_t)(kv_first * G + hh) * q_head_stride;
        __m512 x[8], amax_v = _mm512_setzero_ps();
        __mmask16 nan = 0;
        for (int c = 0; c < NC; c++) x[c] = _mm512_loadu_ps(src + 16 * c);
        fwht_normalized_x16(x, NC);
        for (int c = 0; c < NC; c++) {
            nan |= _mm512_cmp_ps_mask(x[c], x[c], _CMP_UNORD_Q);
            amax_v = _mm512_max_ps(amax_v, _mm512_abs_ps(x[c]));
        }
        const float amax = nan ? NAN : _mm512_reduce_max_ps(amax_v);
        /* A NaN or infinite query: q16 = 0 and a NaN or infinite scale, so
         * every score is NaN (0 x inf included), as exact attention's. A
         * query too small to invert (32767 / max|q| overflows) rounds to +-32767 or 0. */
        const float inv = amax > 0.f && amax < INFINITY ? 32767.f / amax : 0.f;
        qscale[hh] = amax / 32767.f * scale;
        const __m512 vinv = _mm512_set1_ps(inv), hi = _mm512_set1_ps(32767.f), lo = _mm512_set1_ps(-32767.f);
        for (int c = 0; c < NC; c++) {
            const __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(x[c], vinv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            const __mmask16 ok = _mm512_cmp_ps_mask(r, r, _CMP_ORD_Q);
            const __m512i q32 = _mm512_cvtps_epi32(_mm512_maskz_mov_ps(ok, _mm512_min_ps(_mm512_max_ps(r, lo), hi)));
            _mm256_store_si256((__m256i *)(qw[hh] + 16 * c), _mm512_cvtepi32_epi16(q32));
        }
        for (int c = 0; c < NC; c++) acc_mem[hh][c] = _mm512_setzero_ps();
        m[hh] = -INFINITY;
        l[hh] = _mm512_setzero_ps();
    }
    const int8_t *kc = (const int8_t *)k_cache, *vc = (const int8_t *)v_cache;
    const int64_t first_off = (int64_t)kv_first * head_len;
    int64_t rows_a[CHUNK], rows_b[CHUNK], rows_c[CHUNK], *rows = rows_a, *next = rows_b, *far = rows_c;
    chunk_rows(rows, table, 0, len, block_size, row_len);
    int n_next = CHUNK < len ? chunk_rows(next, table, CHUNK, len, block_size, row_len) : 0;
    for (int t0 = 0; t0 < len; t0 += CHUNK) {
        const int n = len - t0 < CHUNK ? len - t0 : CHUNK;
        const __mmask16 valid = (__mmask16)((1u << n) - 1);
        const int n_far = t0 + 2 * CHUNK < len ? chunk_rows(far, table, t0 + 2 * CHUNK, len, block_size, row_len) : 0;
        for (int kv = 0; kv < kv_count; kv++) {
            const int64_t off = first_off + (int64_t)kv * head_len;
            /* The chunk's K and V scales (rows past n repeat row 0's: finite, masked). */
            float ks[CHUNK] __attribute__((aligned(64))), vs[CHUNK] __attribute__((aligned(64)));
            for (int j = 0; j < CHUNK; j++) {
                memcpy(ks + j, kc + rows[j] + off + D, sizeof(float));
                memcpy(vs + j, vc + rows[j] + off + D, sizeof(float));
            }
            const __m512 kscale = _mm512_load_ps(ks), vscale = _mm512_load_ps(vs);
#pragma GCC unroll 8
            for (int h = 0; h < G; h++) {
                const int hh = kv * G + h;
                __m512i part[CHUNK];
#pragma GCC unroll 16
                for (int j = 0; j < CHUNK; j++) part[j] = _mm512_setzero_si512();
#pragma GCC unroll 4
                for (int w = 0; w < NW; w++) {
                    const __m512i qv = _mm512_load_si512((const void *)(qw[hh] + 32 * w));
#pragma GCC unroll 16
                    for (int j = 0; j < CHUNK; j++) {
                        const __m256i raw = _mm256_loadu_si256((const __m256i *)(kc + rows[j] + off + 32 * w));
                        part[j] = DOT_I16(part[j], qv, _mm512_cvtepi8_epi16(raw));
                    }
                }
                __m512 sums[CHUNK];
#pragma GCC unroll 16
                for (int j = 0; j < CHUNK; j++) sums[j] = _mm512_cvtepi32_ps(part[j]);
                const __m512 s = _mm512_mask_mov_ps(
                    _mm512_set1_ps(-INFINITY), valid,
                    _mm512_mul_ps(_mm512_mul_ps(sum16(sums), kscale), _mm512_set1_ps(qscale[hh])));
                /* A head's D + 4 bytes may start anywhere in a line: up to three lines. */
                prefetch_share((const char *)kc, (const char *)vc, far, n_far, next, n_next, h, G, off, 1,
                               head_len + 63);
                lazy_rescale(s, &m[hh], &l[hh], acc_mem[hh], NC);
                const __m512 e = _mm512_maskz_mov_ps(valid, exp512(_mm512_sub_ps(s, _mm512_set1_ps(m[hh]))));
                l[hh] = _mm512_add_ps(l[hh], e);
                _mm512_store_ps(pb[hh], _mm512_mul_ps(e, vscale));
            }
        }
        for (int kv = 0; kv < kv_count; kv++) {
            const int64_t off = first_off + (int64_t)kv * head_len;
            __m512 acc[8][8];
#pragma GCC unroll 8
            for (int h = 0; h < G; h++)
#pragma GCC unroll 8
                for (int c = 0; c < NC; c++) acc[h][c] = acc_mem[kv * G + h][c];
            for (int j = 0; j < n; j++) {
#pragma GCC unroll 8
                for (int c = 0; c < NC; c++) {
                    const __m128i raw = _mm_loadu_si128((const __m128i *)(vc + rows[j] + off + 16 * c));
                    const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw));
#pragma GCC unroll 8
                    for (int h = 0; h < G; h++)
                        acc[h][c] = _mm512_fmadd_ps(_mm512_set1_ps(pb[kv * G + h][j]), v, acc[h][c]);
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
        const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(l[hh]));
        float *dst = out + (int64_t)(kv_first * G + hh) * out_head_stride;
        for (int c = 0; c < NC; c++) _mm512_storeu_ps(dst + 16 * c, _mm512_mul_ps(acc_mem[hh][c], inv));
    }
}

/* One instance per (heads per KV head, head_dim / 16). */
#define INT8_INSTANCE(G, NC)                                                                                    \
    static void decode_int8_##G##_##NC(float *o, int64_t os, const float *q, int64_t qs, const void *k,         \
                                       const void *v, const int32_t *t, int len, int bs, int64_t rl, int kv,   \
                                       int nkv, float sc) {                                                    \
        decode_int8_heads(G, NC, o, os, q, qs, k, v, t, len, bs, rl, kv, nkv, sc);                             \
    }
#define INT8_INSTANCES(G) INT8_INSTANCE(G, 4) INT8_INSTANCE(G, 8)
INT8_INSTANCES(1) INT8_INSTANCES(2) INT8_INSTANCES(3) INT8_INSTANCES(4)
INT8_INSTANCES(5) INT8_INSTANCES(6) INT8_INSTANCES(7) INT8_INSTANCES(8)
#undef INT8_INSTANCES
#undef INT8_INSTANCE

#define INT8_GROUP(G) {decode_int8_##G##_4, decode_int8_##G##_8}
static const decode_fn DECODE_FNS_int8[8][2] = {INT8_GROUP(1), INT8_GROUP(2), INT8_GROUP(3), INT8_GROUP(4),
                                                INT8_GROUP(5), INT8_GROUP(6), INT8_GROUP(7), INT8_GROUP(8)};
#undef INT8_GROUP
