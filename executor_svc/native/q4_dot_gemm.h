/* The bf16 dot-product GEMM over GGUF Q4_1 block panels (route "gguf_dot"),
 * for CPUs with AVX512-BF16: C[M, N] = bf16(A)[M, K] @ W[N, K]^T (+ bias),
 * W the file's Q4_1 weight, w_k = d q_k + m per column and block of 32 k.
 *
 * Included twice by packed_gemm.c, as bf16_dot_gemm.h is: DOT_NAME(x) names
 * this instance's functions, DOT_TARGET its target attribute and
 * DOT(acc, a, b) its pair product (VDPBF16PS, or its emulation, which every
 * AVX-512 CPU runs and tests).
 *
 * Why: at a few rows the float32 path over these blocks (fused_blocks.h)
 * is compute bound, not DRAM bound. It widens every code to float32
 * (shuffle, mask, convert, fma(d, code, m)) before one FMA per row: 2.0-2.7
 * cycles per 16 weights, so a one-decode step of SmolLM2 read its 66 MB of
 * Q4_1 blocks at 15-18 GB/s on an AMD EPYC, about half of what its memory
 * gives (docs/optimization_log.md, twentieth session). Here a 4-bit code q becomes the bfloat16
 * 128 + q with one bitwise op: 0x4300 | q is 128's exponent with q in the
 * low mantissa bits, exactly. One VDPBF16PS then multiplies 16 columns x 2
 * k of codes by a broadcast pair of activations, and per block, column and
 * row the weights' scale and offset come in once:
 *
 *     sum_k w_k x_k = d * sum_k (128 + q_k) x_k + (m - 128 d) * S,   S = sum_k x_k
 *
 * with x the row rounded to bfloat16 (as the "dot" route rounds it) and S
 * its block's sum, both computed once per call (bf16_rows_with_sums). The
 * products (128 + q) x are exact in float32; the 128 S the second term takes
 * back is cancelled to float32 rounding of about 128 |d S|, which for a
 * Q4_1 block (|w| up to ~16 d) is a few float32 ulps of the output, far
 * below the activations' own bf16 rounding (2^-9). Not the float32 path's
 * bits, so the route is never taken under --deterministic.
 *
 * Layout (packed_gemm.c): a Q4_1 block of a panel is f16 d[48], f16 m[48],
 * u8 q[4][48][4]; byte i of column c in group g holds k = 4g+i in its low
 * nibble and k = 16+4g+i in its high one. One in-lane byte shuffle turns a
 * 64-byte load (16 columns x 4 bytes) into the column's k pairs (4g, 4g+1)
 * and (4g+2, 4g+3), one word per code; the same shuffle of the load shifted
 * right by 4 gives the high nibbles' pairs.
 *
 * Tiles: up to Q4DOT_TILE_ROWS rows x the panel's 48 columns, a block's
 * sums and the running sums in registers; threads, chunks of rows and the
 * prefetch of the next panel's block are the int8 kernel's (row_tiles.h).
 */

static inline __attribute__((always_inline)) DOT_TARGET void DOT_NAME(q4_tile)(
    int mr, float *c_out, int64_t ldc, const uint16_t *xb, int64_t ldx, const float *xs, int64_t lds,
    const uint8_t *panel, const float *bias, int K, int ncols, int64_t pf_ahead)
{
    __mmask16 mask[NV];
    for (int j = 0; j < NV; j++)
        mask[j] = column_mask(ncols, j);
    __m512 y[Q4DOT_TILE_ROWS][NV];
    for (int j = 0; j < NV; j++) {
        const __m512 init = bias ? _mm512_maskz_loadu_ps(mask[j], bias + 16 * j) : _mm512_setzero_ps();
        for (int i = 0; i < mr; i++)
            y[i][j] = init;
    }
    /* Bytes (0, 1) and (2, 3) of each 32-bit lane, each into the low byte of a word. */
    const __m512i first = _mm512_broadcast_i32x4(_mm_setr_epi32((int)0x80018000u, (int)0x80058004u,
                                                                 (int)0x80098008u, (int)0x800D800Cu));
    const __m512i second = _mm512_broadcast_i32x4(_mm_setr_epi32((int)0x80038002u, (int)0x80078006u,
                                                                  (int)0x800B800Au, (int)0x800F800Eu));
    const __m512i nibble = _mm512_set1_epi16(0x000F), exponent = _mm512_set1_epi16(0x4300);
    const int64_t block_bytes = quant_block_bytes(FMT_Q4_1);
    const int lines = (int)((block_bytes + 63) / 64), groups = QK / 8;
    for (int b = 0; b < K / QK; b++) {
        const uint8_t *qp = panel + (int64_t)b * block_bytes;
        const char *pf = pf_ahead ? (const char *)qp + pf_ahead : 0;
        const uint8_t *codes = qp + 4 * NR;
        __m512 acc[Q4DOT_TILE_ROWS][NV];
        for (int i = 0; i < mr; i++)
            for (int j = 0; j < NV; j++)
                acc[i][j] = _mm512_setzero_ps();
#pragma GCC unroll 4
        for (int g = 0; g < groups; g++) {
            if (pf)
                for (int l = g * lines / groups; l < (g + 1) * lines / groups; l++)
                    _mm_prefetch(pf + 64 * l, _MM_HINT_T1);
            for (int j = 0; j < NV; j++) {
                const __m512i v = _mm512_loadu_si512((const void *)(codes + g * 4 * NR + 64 * j));
                const __m512i high = _mm512_srli_epi32(v, 4);
                /* (A & nibble) | exponent: the bfloat16 128 + code of each word. */
                __m512i w[4] = {_mm512_shuffle_epi8(v, first), _mm512_shuffle_epi8(v, second),
                                _mm512_shuffle_epi8(high, first), _mm512_shuffle_epi8(high, second)};
                for (int t = 0; t < 4; t++)
                    w[t] = _mm512_ternarylogic_epi32(w[t], nibble, exponent, 0xEA);
                for (int i = 0; i < mr; i++) {
                    /* k pairs 4g, 4g+2 (low nibbles) and 16+4g, 18+4g (high ones). */
                    const uint16_t *x = xb + i * ldx + b * QK + 4 * g;
                    int32_t p[4];
                    __builtin_memcpy(&p[0], x, 4);
                    __builtin_memcpy(&p[1], x + 2, 4);
                    __builtin_memcpy(&p[2], x + QK / 2, 4);
                    __builtin_memcpy(&p[3], x + QK / 2 + 2, 4);
                    for (int t = 0; t < 4; t++)
                        acc[i][j] = DOT(acc[i][j], _mm512_set1_epi32(p[t]), w[t]);
                }
            }
        }
        const uint16_t *scales = (const uint16_t *)qp;
        for (int j = 0; j < NV; j++) {
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scales + 16 * j)));
            const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scales + NR + 16 * j)));
            const __m512 offset = _mm512_fnmadd_ps(_mm512_set1_ps(128.0f), d, m); /* m - 128 d */
            for (int i = 0; i < mr; i++) {
                y[i][j] = _mm512_fmadd_ps(d, acc[i][j], y[i][j]);
                y[i][j] = _mm512_fmadd_ps(offset, _mm512_set1_ps(xs[i * lds + b]), y[i][j]);
            }
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < NV; j++)
            _mm512_mask_storeu_ps(c_out + i * ldc + 16 * j, mask[j], y[i][j]);
}

static DOT_TARGET void DOT_NAME(q4_rows)(int mr, float *c_out, int64_t ldc, const uint16_t *xb, int64_t ldx,
                                         const float *xs, int64_t lds, const uint8_t *panel, const float *bias, int K,
                                         int ncols, int64_t pf_ahead)
{
    switch (mr) {
    case 4: DOT_NAME(q4_tile)(4, c_out, ldc, xb, ldx, xs, lds, panel, bias, K, ncols, pf_ahead); break;
    case 3: DOT_NAME(q4_tile)(3, c_out, ldc, xb, ldx, xs, lds, panel, bias, K, ncols, pf_ahead); break;
    case 2: DOT_NAME(q4_tile)(2, c_out, ldc, xb, ldx, xs, lds, panel, bias, K, ncols, pf_ahead); break;
    default: DOT_NAME(q4_tile)(1, c_out, ldc, xb, ldx, xs, lds, panel, bias, K, ncols, pf_ahead); break;
    }
}

static DOT_TARGET void DOT_NAME(q4_call_tile)(const void *call, int m, int mr, int64_t p, int ncols,
                                               int64_t pf_ahead)
{
    const struct q4_dot_call *g = call;
    DOT_NAME(q4_rows)(mr, g->c + m * g->ldc + p * NR, g->ldc, g->xb + (int64_t)m * g->K, g->K,
                      g->xs + (int64_t)m * (g->K / QK), g->K / QK, g->blocks + p * g->panel_bytes,
                      g->bias ? g->bias + p * NR : 0, g->K, ncols, pf_ahead);
}

static void DOT_NAME(q4_gemm)(const struct q4_dot_call *call, int M, int N, int num_threads)
{
    for_each_row_tile(call, DOT_NAME(q4_call_tile), M, N, 2 * call->K, Q4DOT_TILE_ROWS, call->panel_bytes,
                      num_threads);
}
