/* GEMM over GGUF Q4_1/Q8_0 block panels with int8 activations and integer
 * dot products (VPDPBUSD, AVX512-VNNI): llama.cpp's CPU arithmetic, for
 * decode batches and prefill chunks alike (--gguf-activations int8).
 * Included once by packed_gemm.c, after the block layout and gemm_blocks.
 *
 * Why: at a few rows the float32 block path (fused_blocks.h) is compute
 * bound, not DRAM bound: every weight is widened to float32 (zero-extend,
 * mask, convert, fma(d, code, m)) before one FMA per row, 2.7-3.5 cycles
 * per 16 weights. Here each activation row is quantised once per call to
 * int8 in blocks of 32 k, and one VPDPBUSD multiplies 16 columns x 4 k of
 * codes (u8) by 4 activations (s8), summing into 16 int32 lanes: an eighth
 * of the instructions per weight and row, no widening. At prefill sizes,
 * where float32 GEMMs run at the FMA peak, its 4 products per lane make it
 * 1.4x MKL's float32 at 2,048 rows (2 threads).
 *
 * Activations (quantize_rows, as llama.cpp's Q8_1 quantisation): per row
 * and block b of 32 k, with amax = max |x_k|,
 *
 *     dx = amax / 127,   xq_k = round_to_nearest_even(x_k * (127 / amax))   (0 where amax == 0),
 *     sx = dx * sum_k xq_k                                   (float32, rounded once)
 *
 * Per block, column and row, the integer sum is exact, and the float32
 * part is two roundings and two FMAs:
 *
 *     Q4_1   w_k = dw code_k + mw:
 *            sum_k w_k dx xq_k = (dw dx) sum_k code_k xq_k + mw sx
 *     Q8_0   w_k = dw code_k, codes signed: VPDPBUSD's unsigned operand is
 *            code_k + 128 (a sign-bit flip), and the bias comes off the
 *            integer sum: sum_k code_k xq_k = sum_k (code_k + 128) xq_k - 128 sum_k xq_k
 *
 *     acc = fma(dw * dx, float(isum), acc) [; acc = fma(mw, sx, acc)]
 *
 * from the bias (or zero), block after block. So the result is the float64
 * product of the quantised activations and the dequantised weights up to
 * float32 rounding of K/32 block terms; it differs from the float32 path's
 * by the activations' int8 rounding (about 1/254 of each block's largest
 * value), which is why this route is an option (--gguf-activations int8),
 * never taken under --deterministic (its sums also differ in order).
 *
 * |isum| stays below 2^24 (Q4_1: 32 x 15 x 127; Q8_0: 32 x 128 x 127 after
 * the bias comes off; 32 x 255 x 127 before), so float(isum) is exact.
 *
 * Tiles: up to INT8_TILE_ROWS rows x the panel's 48 columns, int32 sums of
 * the current block and float32 sums in registers; more rows pass over the
 * panel again, from cache, in chunks of rows that stay in L2 (gemm_int8).
 * Threads split the panels as gemm_blocks does (or, for a weight with few
 * panels, the (chunk, panel) pairs), and while the first row tile of a
 * panel reads block b, it prefetches block b of the next panel the same
 * thread computes. Every output is one tile's whole sum over k, so neither
 * the chunks nor the threads change a result.
 */
#define INT8_TILE_ROWS 4
#define INT8_TARGET __attribute__((target("avx512f,avx512vnni")))

/* One row's quantised activations: xq [K], per block dx, sx and 128 sum xq. */
struct int8_row {
    const int8_t *q;
    const float *d, *s;
    const int32_t *bias128;
};

/* Quantises rows of a [M, K] into q [M][K], d, s, bias128 [M][K/32] (see
 * above); rows shared out among threads when there are enough of them (a
 * prefill chunk's: ~1 ms of 2,048 x 1,536 on one thread), each row's values
 * the same whoever computes them. */
static void quantize_rows(int8_t *q, float *d, float *s, int32_t *bias128, const float *a, int64_t lda, int M, int K,
                          int num_threads)
{
    const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
#pragma omp parallel for num_threads(num_threads) schedule(static) if (M >= 64 && num_threads > 1)
    for (int r = 0; r < M; r++)
        for (int b = 0; b < K / QK; b++) {
            const float *x = a + r * lda + b * QK;
            const __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(x0, sign), _mm512_and_ps(x1, sign)));
            const __m512 id = _mm512_set1_ps(amax != 0.0f ? 127.0f / amax : 0.0f);
            /* cvtps rounds to nearest even (the default MXCSR mode). */
            const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, id)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, id));
            _mm_storeu_si128((__m128i *)(q + (int64_t)r * K + b * QK), _mm512_cvtsepi32_epi8(q0));
            _mm_storeu_si128((__m128i *)(q + (int64_t)r * K + b * QK + 16), _mm512_cvtsepi32_epi8(q1));
            const int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
            const int64_t at = (int64_t)r * (K / QK) + b;
            d[at] = amax / 127.0f;
            s[at] = d[at] * (float)sum;
            bias128[at] = 128 * sum;
        }
}

static inline __attribute__((always_inline)) INT8_TARGET void int8_tile(
    int mr, int fmt, float *c_out, int64_t ldc, const struct int8_row *x, const uint8_t *panel, const float *bias,
    int K, int ncols, int64_t pf_ahead)
{
    __mmask16 mask[NV];
    for (int j = 0; j < NV; j++)
        mask[j] = column_mask(ncols, j);
    __m512 acc[INT8_TILE_ROWS][NV];
    for (int j = 0; j < NV; j++) {
        const __m512 init = bias ? _mm512_maskz_loadu_ps(mask[j], bias + 16 * j) : _mm512_setzero_ps();
        for (int i = 0; i < mr; i++)
            acc[i][j] = init;
    }
    const int64_t block_bytes = quant_block_bytes(fmt);
    const int lines = (int)((block_bytes + 63) / 64);
    const int groups = fmt == FMT_Q4_1 ? QK / 8 : QK / 4; /* 64-byte loads per column vector */
    const int codes_at = fmt == FMT_Q4_1 ? 4 * NR : 2 * NR; /* bytes of scales before the codes */
    for (int b = 0; b < K / QK; b++) {
        const uint8_t *qp = panel + (int64_t)b * block_bytes;
        const char *pf = pf_ahead ? (const char *)qp + pf_ahead : 0;
        const uint8_t *codes = qp + codes_at;
        __m512i isum[INT8_TILE_ROWS][NV];
        for (int i = 0; i < mr; i++)
            for (int j = 0; j < NV; j++)
                isum[i][j] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int g = 0; g < groups; g++) {
            /* The same block of the next panel, spread over the groups, into
             * L2 (SmolLM2's 121 linears read 5-10% faster with than without;
             * T0 and T1 even). */
            if (pf)
                for (int l = g * lines / groups; l < (g + 1) * lines / groups; l++)
                    _mm_prefetch(pf + 64 * l, _MM_HINT_T1);
            for (int j = 0; j < NV; j++) {
                const __m512i v = _mm512_loadu_si512((const void *)(codes + g * 4 * NR + 64 * j));
                if (fmt == FMT_Q4_1) {
                    /* Low nibbles: k = 4g..4g+3; high: k = 16+4g..16+4g+3. */
                    const __m512i low = _mm512_set1_epi8(15);
                    const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi32(v, 4), low);
                    for (int i = 0; i < mr; i++) {
                        const int8_t *xb = x[i].q + b * QK + 4 * g;
                        int32_t x_lo, x_hi;
                        __builtin_memcpy(&x_lo, xb, 4);
                        __builtin_memcpy(&x_hi, xb + QK / 2, 4);
                        isum[i][j] = _mm512_dpbusd_epi32(isum[i][j], lo, _mm512_set1_epi32(x_lo));
                        isum[i][j] = _mm512_dpbusd_epi32(isum[i][j], hi, _mm512_set1_epi32(x_hi));
                    }
                } else {
                    const __m512i u = _mm512_xor_si512(v, _mm512_set1_epi8((char)0x80)); /* code + 128 */
                    for (int i = 0; i < mr; i++) {
                        int32_t xg;
                        __builtin_memcpy(&xg, x[i].q + b * QK + 4 * g, 4);
                        isum[i][j] = _mm512_dpbusd_epi32(isum[i][j], u, _mm512_set1_epi32(xg));
                    }
                }
            }
        }
        const uint16_t *scales = (const uint16_t *)qp;
        for (int j = 0; j < NV; j++) {
            const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scales + 16 * j)));
            const __m512 mw =
                fmt == FMT_Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scales + NR + 16 * j))) : dw;
            for (int i = 0; i < mr; i++) {
                __m512i exact = isum[i][j];
                if (fmt == FMT_Q8_0)
                    exact = _mm512_sub_epi32(exact, _mm512_set1_epi32(x[i].bias128[b]));
                const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(x[i].d[b]));
                acc[i][j] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(exact), acc[i][j]);
                if (fmt == FMT_Q4_1)
                    acc[i][j] = _mm512_fmadd_ps(mw, _mm512_set1_ps(x[i].s[b]), acc[i][j]);
            }
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < NV; j++)
            _mm512_mask_storeu_ps(c_out + i * ldc + 16 * j, mask[j], acc[i][j]);
}

/* One instance per (format, row count): constant loops, sums in registers. */
#define INT8_FORMATS(mr)                                                                  \
    fmt == FMT_Q4_1 ? int8_tile(mr, FMT_Q4_1, c_out, ldc, x, panel, bias, K, ncols, pf_ahead) \
                    : int8_tile(mr, FMT_Q8_0, c_out, ldc, x, panel, bias, K, ncols, pf_ahead)

static INT8_TARGET void int8_rows(int mr, int fmt, float *c_out, int64_t ldc, const struct int8_row *x,
                                  const uint8_t *panel, const float *bias, int K, int ncols, int64_t pf_ahead)
{
    switch (mr) {
    case 4: INT8_FORMATS(4); break;
    case 3: INT8_FORMATS(3); break;
    case 2: INT8_FORMATS(2); break;
    default: INT8_FORMATS(1); break;
    }
}
#undef INT8_FORMATS

struct int8_call {
    float *c;
    int64_t ldc;
    const struct int8_row *x;
    const uint8_t *blocks;
    int fmt, K;
    const float *bias;
    int64_t panel_bytes;
};

static INT8_TARGET void int8_call_tile(const void *call, int m, int mr, int64_t p, int ncols, int64_t pf_ahead)
{
    const struct int8_call *g = call;
    int8_rows(mr, g->fmt, g->c + m * g->ldc + p * NR, g->ldc, g->x + m, g->blocks + p * g->panel_bytes,
              g->bias ? g->bias + p * NR : 0, g->K, ncols, pf_ahead);
}

static void gemm_int8(float *c, int64_t ldc, const struct int8_row *x, const uint8_t *blocks, int fmt,
                      const float *bias, int M, int N, int K, int num_threads)
{
    const struct int8_call call = {c, ldc, x, blocks, fmt, K, bias, (int64_t)(K / QK) * quant_block_bytes(fmt)};
    for_each_row_tile(&call, int8_call_tile, M, N, K, INT8_TILE_ROWS, call.panel_bytes, num_threads);
}
