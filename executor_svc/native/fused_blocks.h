/* The block path's few-row kernel (gemm_blocks in packed_gemm.c): for
 * 1..FUSED_MAX_ROWS rows, each block's weights are widened in registers and
 * multiplied straight into the accumulators, with no float32 buffer between.
 *
 * Why: at a few rows the block path ought to wait on DRAM, but its
 * expansion buffer cost more than the arithmetic: every 16 weights were
 * widened, stored to L1 and loaded back for one FMA per row. Here the same
 * 16 weights cost their widening and one FMA per row, no store: in cache,
 * 2.0-2.7 cycles per 16 weights at one row instead of 4-5.5, and SmolLM2's
 * GGUF blocks read 1.2-1.3x faster at 1-4 rows (docs/optimization_log.md).
 * Past 4 rows the register pressure (3 x rows accumulators beside Q4_1's 6
 * scale vectors), or widening each block once per 4-row pass, lost to the
 * buffer for Q4_1 (measured at 5-8 rows), so FUSED_MAX_ROWS is 4.
 *
 * Same results bit for bit: each output is still one FMA chain from its
 * bias (or zero) over k = 0..K-1 in order, fma(x_k, w_k, acc), and w_k is
 * the very float32 value expand_block writes: fma(d, code, m) rounded once
 * (Q4_1), d * code (Q8_0), the exact widening (BF16). A Q4_1 block's k 0..15
 * are the low nibbles of its codes, k 16..31 the high ones, so the codes are
 * read twice (from L1) to keep k in order; a BF16 pair's even k is the low
 * half of each 32-bit lane and is multiplied first.
 *
 * Threads, (chunk, panel) items and the prefetch of the same block of the
 * next panel (spread over the block's k steps, as expand_block spreads it)
 * are gemm_blocks' own.
 */
#define FUSED_MAX_ROWS 4

/* Line l of `lines` is prefetched at step floor(l * steps / lines): evenly
 * spread, constant per step once the k loop is unrolled. */
static inline __attribute__((always_inline)) void prefetch_share(const char *pf, int step, int steps, int lines)
{
    if (!pf)
        return;
    for (int l = (step * lines + steps - 1) / steps; l < ((step + 1) * lines + steps - 1) / steps; l++)
        _mm_prefetch(pf + 64 * l, _MM_HINT_T0);
}

/* acc[i][j] += x[i][k] * w[j] for one k: the shared inner step. */
#define FMA_ROWS(mr, acc, a, lda, k, w)                                       \
    for (int i_ = 0; i_ < (mr); i_++) {                                       \
        const __m512 x_ = _mm512_set1_ps((a)[i_ * (lda) + (k)]);              \
        for (int j_ = 0; j_ < NV; j_++)                                       \
            (acc)[i_][j_] = _mm512_fmadd_ps(x_, (w)[j_], (acc)[i_][j_]);      \
    }

static inline __attribute__((always_inline)) void fused_tile(
    int mr, int fmt, float *c_out, int64_t ldc, const float *a, int64_t lda, const uint8_t *panel,
    const float *bias, int K, int ncols, int64_t pf_ahead)
{
    __mmask16 mask[NV];
    for (int j = 0; j < NV; j++)
        mask[j] = column_mask(ncols, j);
    __m512 acc[FUSED_MAX_ROWS][NV];
    for (int j = 0; j < NV; j++) {
        const __m512 init = bias ? _mm512_maskz_loadu_ps(mask[j], bias + 16 * j) : _mm512_setzero_ps();
        for (int i = 0; i < mr; i++)
            acc[i][j] = init;
    }
    const int64_t block_bytes = quant_block_bytes(fmt);
    const int lines = (int)((block_bytes + 63) / 64);
    for (int b = 0; b < K / QK; b++) {
        const uint8_t *qp = panel + (int64_t)b * block_bytes;
        const char *pf = pf_ahead ? (const char *)qp + pf_ahead : 0;
        const float *ab = a + b * QK;
        const uint16_t *scales = (const uint16_t *)qp;
        __m512 w[NV];
        if (fmt == FMT_BF16) {
            const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
#pragma GCC unroll 16
            for (int s = 0; s < QK / 2; s++) {
                prefetch_share(pf, s, QK / 2, lines);
                __m512i v[NV];
                for (int j = 0; j < NV; j++) {
                    v[j] = _mm512_loadu_si512((const void *)(qp + 64 * (s * NV + j)));
                    w[j] = _mm512_castsi512_ps(_mm512_slli_epi32(v[j], 16));
                }
                FMA_ROWS(mr, acc, ab, lda, 2 * s, w);
                for (int j = 0; j < NV; j++)
                    w[j] = _mm512_castsi512_ps(_mm512_and_si512(v[j], high));
                FMA_ROWS(mr, acc, ab, lda, 2 * s + 1, w);
            }
        } else if (fmt == FMT_Q4_1) {
            __m512 d[NV], m[NV];
            for (int j = 0; j < NV; j++) {
                d[j] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scales + 16 * j)));
                m[j] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scales + NR + 16 * j)));
            }
            const uint8_t *q = qp + 4 * NR;
#pragma GCC unroll 32
            for (int k = 0; k < QK; k++) {
                /* Reload the codes for k 16..31: kept live from k 0..15
                 * (the compiler's choice, unprompted) they spill at 4 rows. */
                if (k == QK / 2)
                    __asm__ volatile("" ::: "memory");
                prefetch_share(pf, k, QK, lines);
                /* Code k is byte k % 4 of group (k % 16) / 4, low nibble below 16. */
                for (int j = 0; j < NV; j++) {
                    const __m512i v = lane_byte(_mm512_loadu_si512((const void *)(q + k % 16 / 4 * 4 * NR + 64 * j)), k % 4);
                    const __m512i code = k < QK / 2 ? _mm512_and_si512(v, _mm512_set1_epi32(15)) : _mm512_srli_epi32(v, 4);
                    w[j] = _mm512_fmadd_ps(d[j], _mm512_cvtepi32_ps(code), m[j]);
                }
                FMA_ROWS(mr, acc, ab, lda, k, w);
            }
        } else {
            __m512 d[NV]; /* d * 2^-24, for codes << 24 (Q8_UNSHIFT) */
            for (int j = 0; j < NV; j++)
                d[j] = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scales + 16 * j))),
                                     _mm512_set1_ps(Q8_UNSHIFT));
            const uint8_t *q = qp + 2 * NR;
#pragma GCC unroll 32
            for (int k = 0; k < QK; k++) {
                prefetch_share(pf, k, QK, lines);
                for (int j = 0; j < NV; j++) {
                    const __m512i v = _mm512_loadu_si512((const void *)(q + k / 4 * 4 * NR + 64 * j));
                    w[j] = _mm512_mul_ps(d[j], _mm512_cvtepi32_ps(lane_byte_high(v, k % 4)));
                }
                FMA_ROWS(mr, acc, ab, lda, k, w);
            }
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < NV; j++)
            _mm512_mask_storeu_ps(c_out + i * ldc + 16 * j, mask[j], acc[i][j]);
}
#undef FMA_ROWS

/* One instance per (format, row count): constant loops, accumulators in registers. */
#define FUSED_FORMATS(mr)                                                                            \
    fmt == FMT_BF16   ? fused_tile(mr, FMT_BF16, c_out, ldc, a, lda, panel, bias, K, ncols, pf_ahead) \
    : fmt == FMT_Q4_1 ? fused_tile(mr, FMT_Q4_1, c_out, ldc, a, lda, panel, bias, K, ncols, pf_ahead) \
                      : fused_tile(mr, FMT_Q8_0, c_out, ldc, a, lda, panel, bias, K, ncols, pf_ahead)

static void fused_rows(int mr, int fmt, float *c_out, int64_t ldc, const float *a, int64_t lda,
                       const uint8_t *panel, const float *bias, int K, int ncols, int64_t pf_ahead)
{
    switch (mr) {
    case 4: FUSED_FORMATS(4); break;
    case 3: FUSED_FORMATS(3); break;
    case 2: FUSED_FORMATS(2); break;
    default: FUSED_FORMATS(1); break;
    }
}
#undef FUSED_FORMATS
