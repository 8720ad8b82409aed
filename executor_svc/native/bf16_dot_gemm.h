/* The bf16 dot-product GEMM over BF16 block panels (packed_gemm.c), for CPUs
 * with AVX512-BF16: C[M, N] = A[M, K] @ W[N, K]^T (+ bias), A in bfloat16.
 *
 * Included twice by packed_gemm.c, with DOT_NAME(x) naming this instance's
 * functions, DOT_TARGET its target attribute and DOT(acc, a, b) its pair
 * product:
 *
 *     native     _mm512_dpbf16_ps (VDPBF16PS), built for AVX512-BF16 and
 *                called only where the CPU has it;
 *     emulated   the instruction's arithmetic in AVX-512F FMAs, so that every
 *                CPU the kernel builds on runs (and tests) this loop; they
 *                agree within about one rounding per k pair (bf16_dot.h).
 *
 * A BF16 block holds bf16 w[16][48][2]: for each pair of consecutive k, the
 * panel's 48 columns, each column's two weights side by side. That is the
 * operand order of VDPBF16PS: one 64-byte load is 16 columns x 2 k, and a
 * 32-bit broadcast of A's same two k multiplies it into 16 float32 sums,
 *
 *     acc[c] += a[2s+1] * w[c][2s+1];  acc[c] += a[2s] * w[c][2s]
 *
 * (Intel's definition: two FMAs, odd k first, products of bf16 values exact
 * in float32). So a k pair costs one instruction per 16 outputs where the
 * widening path (expand_block + tile) costs two FMAs, a widening and a store
 * and reload: twice the multiply rate once the rows make the GEMM compute
 * bound, and no expansion buffer. The price is A rounded to bfloat16 (as a
 * bf16 model's activations are in torch and oneDNN) and a k order that
 * differs from the widening path's, so its sums are not those bit for bit.
 *
 * Blocks are contiguous within a panel, so a panel is K/2 steps of
 * 192 bytes read front to back; tiles, chunks, threads and the prefetch of
 * the next panel are those of packed_gemm's float32 kernel.
 *
 * Warming (packed_gemm_bf16_dot_warm): a compute-bound GEMM leaves the
 * memory bus idle, and the decoder stack knows which memory the next
 * latency-bound kernel will read (the next layer's key blocks). Given a
 * list of spans, each thread takes its share of their lines and spreads it
 * over its tiles' k steps as it does the next panel's, prefetching with the
 * T2 hint (into L2 on AMD and Intel cores), from which the lines fall into
 * the L3 to wait there. T0 cost the GEMM more for the same gain.
 *
 * Argmax (packed_gemm_bf16_dot_argmax): a greedy step needs each row's
 * largest logit, not the [M, vocab] float32 logits, which at the LM head's
 * shape are 12.6 MB at 64 rows: written beside the 57 MB weight stream, then
 * read back from DRAM by the sampler's argmax (0.75 ms of a 32 ms 64-decode
 * step). Here a tile leaves no C: each one is folded into the thread's
 * running best of each row, lane by lane (running_best, fold_tile), and a
 * thread's bests leave once per row chunk (flush_bests); the caller reduces
 * the threads' in column order.
 *
 * Output lines: as packed_gemm's float32 kernel does past
 * PREFETCH_OUT_MIN_BYTES of C, each tile first prefetches, for writing, the
 * 24 lines (8 rows x 48 columns) of the same rows in the next panel, which
 * this thread computes next: at the LM head's shape 1.15-1.16x.
 */

/* Once for both instances: what does not depend on the pair product. */
#ifndef PAGEDSERVE_DOT_GEMM_SHARED
#define PAGEDSERVE_DOT_GEMM_SHARED
/* Where a thread is in its share of the spans to warm. */
struct warm_cursor {
    const char *const *span; /* the span being warmed */
    int64_t off;             /* bytes of it done */
    int64_t span_bytes;
};

/* A thread's running argmax of each row of its current row chunk, over the
 * columns it has computed: per lane, the largest value seen in that lane's
 * columns (16 apart) and the first column holding it, a strict > keeping
 * the earliest since columns arrive in increasing order; and the row's
 * first NaN column, -1 for none (a NaN never enters `value`). */
struct running_best {
    __m512 value[MC];
    __m512i index[MC];
    int32_t nan_at[MC];
};

/* What a thread hands over: row r's best over its columns at [r * slots +
 * thread], a NaN value for a first NaN at `index`; a -inf value, which the
 * caller set beforehand, where it saw none of the row. */
struct thread_bests {
    float *value;
    int32_t *index;
    int slots;
};

static inline void reset_bests(struct running_best *rb, int rows)
{
    for (int i = 0; i < rows; i++) {
        rb->value[i] = _mm512_set1_ps(-INFINITY);
        rb->index[i] = _mm512_setzero_si512();
        rb->nan_at[i] = -1;
    }
}

/* A tile's C (mr rows of NR floats, ncols of them columns col0...) folded
 * into the running bests of rows rb_row...: per row, its NV vectors in
 * column order; lanes past ncols are -inf, which never wins a strict >.
 * The tile stores C and this reads it back from L1: folding the
 * accumulators in registers instead slowed the tile itself by ~20%. */
static inline void fold_tile(struct running_best *rb, int rb_row, const float *c, int mr, int ncols, int col0)
{
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int i = 0; i < mr; i++) {
        __m512 best = rb->value[rb_row + i];
        __m512i index = rb->index[rb_row + i];
        __mmask16 nan = 0;
        for (int j = 0; j < NV; j++) {
            const __mmask16 in = column_mask(ncols, j);
            const __m512 v = _mm512_mask_load_ps(_mm512_set1_ps(-INFINITY), in, c + i * NR + 16 * j);
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
            best = _mm512_mask_mov_ps(best, gt, v);
            index = _mm512_mask_mov_epi32(index, gt, _mm512_add_epi32(lane, _mm512_set1_epi32(col0 + 16 * j)));
        }
        rb->value[rb_row + i] = best;
        rb->index[rb_row + i] = index;
        if (__builtin_expect(nan != 0, 0) && rb->nan_at[rb_row + i] < 0)
            for (int j = 0; j < NV; j++) {
                const __m512 v = _mm512_maskz_load_ps(column_mask(ncols, j), c + i * NR + 16 * j);
                const __mmask16 n = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
                if (n) {
                    rb->nan_at[rb_row + i] = col0 + 16 * j + __builtin_ctz(n);
                    break;
                }
            }
    }
}

/* Rows [row0, row0 + rows) of `rb` into `out` at this thread's slot, each
 * reduced over its lanes as fused_ops.c's scan_row reduces them. */
static inline void flush_bests(const struct running_best *rb, int row0, int rows, const struct thread_bests *out,
                               int thread)
{
    for (int i = 0; i < rows; i++) {
        const int64_t at = (int64_t)(row0 + i) * out->slots + thread;
        if (rb->nan_at[i] >= 0) {
            out->value[at] = NAN;
            out->index[at] = rb->nan_at[i];
            continue;
        }
        const float top = _mm512_reduce_max_ps(rb->value[i]);
        const __mmask16 at_top = _mm512_cmp_ps_mask(rb->value[i], _mm512_set1_ps(top), _CMP_EQ_OQ);
        out->value[at] = top;
        out->index[at] = _mm512_mask_reduce_min_epi32(at_top, rb->index[i]); /* only -inf: every lane's is 0 */
    }
}
#endif

static inline __attribute__((always_inline)) DOT_TARGET void DOT_NAME(tile)(
    int mr, float *c_out, int64_t ldc, const uint16_t *a, int64_t lda, const uint8_t *panel, const float *bias,
    int K, int ncols, const char *pf, int pf_lines, struct warm_cursor *warm, int warm_lines, int pf_out)
{
    __mmask16 mask[NV];
    for (int j = 0; j < NV; j++)
        mask[j] = column_mask(ncols, j);
    __m512 acc[MR][NV];
    for (int j = 0; j < NV; j++) {
        const __m512 init = bias ? _mm512_maskz_loadu_ps(mask[j], bias + 16 * j) : _mm512_setzero_ps();
        for (int i = 0; i < mr; i++)
            acc[i][j] = init;
    }
    if (pf_out)
        prefetch_next_outputs(c_out, ldc, mr);
    const int steps = K / 2;
    int pf_err = 0, warm_err = 0;
    const char *const *span = warm->span;
    int64_t warm_off = warm->off;
#pragma GCC unroll 4
    for (int s = 0; s < steps; s++) {
        const uint8_t *w = panel + (int64_t)s * DOT_STEP_BYTES;
        _mm_prefetch((const char *)(w + PREFETCH_K * DOT_STEP_BYTES), _MM_HINT_T0);
        for (pf_err += pf_lines; pf_err >= steps; pf_err -= steps, pf += 64)
            _mm_prefetch(pf, _MM_HINT_T0);
        for (warm_err += warm_lines; warm_err >= steps; warm_err -= steps) {
            _mm_prefetch(*span + warm_off, _MM_HINT_T2);
            if ((warm_off += 64) >= warm->span_bytes) {
                warm_off = 0;
                span++;
            }
        }
        __m512i wv[NV];
        for (int j = 0; j < NV; j++)
            wv[j] = _mm512_loadu_si512((const void *)(w + 64 * j));
        for (int i = 0; i < mr; i++) {
            int32_t pair;
            __builtin_memcpy(&pair, a + i * lda + 2 * s, sizeof pair);
            const __m512i x = _mm512_set1_epi32(pair);
            for (int j = 0; j < NV; j++)
                acc[i][j] = DOT(acc[i][j], x, wv[j]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < NV; j++)
            _mm512_mask_storeu_ps(c_out + i * ldc + 16 * j, mask[j], acc[i][j]);
    warm->span = span;
    warm->off = warm_off;
}

/* Never inlined: GCC inlined it into the SwiGLU pass, whose tiles then ran
 * ~1.5x slower than the plain GEMM's at 64-256 rows (the GEMM calls it). */
static __attribute__((noinline)) DOT_TARGET void DOT_NAME(tile_rows)(
    int mr, float *c_out, int64_t ldc, const uint16_t *a, int64_t lda, const uint8_t *panel, const float *bias, int K,
    int ncols, const char *pf, int pf_lines, struct warm_cursor *warm, int warm_lines, int pf_out)
{
    switch (mr) {
    case 8: DOT_NAME(tile)(8, c_out, ldc, a, lda, panel, bias, K, ncols, pf, pf_lines, warm, warm_lines, pf_out); break;
    case 7: DOT_NAME(tile)(7, c_out, ldc, a, lda, panel, bias, K, ncols, pf, pf_lines, warm, warm_lines, pf_out); break;
    case 6: DOT_NAME(tile)(6, c_out, ldc, a, lda, panel, bias, K, ncols, pf, pf_lines, warm, warm_lines, pf_out); break;
    case 5: DOT_NAME(tile)(5, c_out, ldc, a, lda, panel, bias, K, ncols, pf, pf_lines, warm, warm_lines, pf_out); break;
    case 4: DOT_NAME(tile)(4, c_out, ldc, a, lda, panel, bias, K, ncols, pf, pf_lines, warm, warm_lines, pf_out); break;
    case 3: DOT_NAME(tile)(3, c_out, ldc, a, lda, panel, bias, K, ncols, pf, pf_lines, warm, warm_lines, pf_out); break;
    case 2: DOT_NAME(tile)(2, c_out, ldc, a, lda, panel, bias, K, ncols, pf, pf_lines, warm, warm_lines, pf_out); break;
    default: DOT_NAME(tile)(1, c_out, ldc, a, lda, panel, bias, K, ncols, pf, pf_lines, warm, warm_lines, pf_out); break;
    }
}

/* num_spans spans of span_bytes each to warm (none: 0) alongside the GEMM. */
static DOT_TARGET void DOT_NAME(gemm)(float *c, int64_t ldc, const uint16_t *a, int64_t lda, const uint8_t *blocks,
                                      const float *bias, int M, int N, int K, int num_threads,
                                      const char *const *spans, int64_t num_spans, int64_t span_bytes)
{
    const int panels = (N + NR - 1) / NR;
    const struct row_split rs = equal_chunks(M, MC, MR);
    const int mcr = rs.rows, chunks = rs.chunks;
    const int64_t panel_bytes = (int64_t)(K / 2) * DOT_STEP_BYTES;
    const int pf_out = (int64_t)M * N * (int64_t)sizeof(float) >= PREFETCH_OUT_MIN_BYTES;
#pragma omp parallel num_threads(num_threads)
    {
        const int64_t items = (int64_t)chunks * panels, nt = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t begin = items * me / nt, end = items * (me + 1) / nt;
        /* This thread's spans, their lines spread evenly over its tiles. */
        const int64_t first_span = num_spans * me / nt, my_spans = num_spans * (me + 1) / nt - first_span;
        struct warm_cursor warm = {spans + first_span, 0, span_bytes};
        const int64_t warm_total = my_spans * ((span_bytes + 63) / 64);
        int64_t my_tiles = 0, tiles_done = 0, warmed = 0;
        for (int64_t it = begin; it < end && warm_total; it++) {
            const int mc = (int)(it / panels), m_end = (mc + 1) * mcr < M ? (mc + 1) * mcr : M;
            my_tiles += (m_end - mc * mcr + MR - 1) / MR;
        }
        for (int64_t it = begin; it < end; it++) {
            const int mc = (int)(it / panels), p = (int)(it % panels);
            const int m_end = (mc + 1) * mcr < M ? (mc + 1) * mcr : M;
            const int ncols = N - p * NR < NR ? N - p * NR : NR;
            const uint8_t *panel = blocks + (int64_t)p * panel_bytes;
            const int num_tiles = (m_end - mc * mcr + MR - 1) / MR;
            const int prefetch = it + 1 < end && p + 1 < panels && panel_bytes <= PREFETCH_MAX_PANEL;
            const int share = prefetch ? (int)(panel_bytes / 64 / num_tiles) : 0;
            const char *next = (const char *)(panel + panel_bytes);
            for (int m = mc * mcr, t = 0; m < m_end; m += MR, t++) {
                const int mr = m_end - m < MR ? m_end - m : MR;
                const int warm_lines = warm_total ? (int)(warm_total * ++tiles_done / my_tiles - warmed) : 0;
                warmed += warm_lines;
                DOT_NAME(tile_rows)(mr, c + m * ldc + p * NR, ldc, a + m * lda, lda, panel, bias ? bias + p * NR : 0,
                                    K, ncols, next + (int64_t)t * share * 64, share, &warm, warm_lines, pf_out);
            }
        }
    }
}

/* Argmax (packed_gemm_bf16_dot_argmax): the GEMM's items, tiles and next
 * panel's prefetch, each tile folded into the thread's running bests
 * instead of stored in C; each thread's bests leave per row chunk into
 * `best` (slots >= num_threads). Its own loop: sharing gemm's, behind a
 * branch on `best`, made the plain GEMM a third slower. */
static DOT_TARGET void DOT_NAME(gemm_argmax)(const uint16_t *a, int64_t lda, const uint8_t *blocks, const float *bias,
                                             int M, int N, int K, int num_threads, const struct thread_bests *best)
{
    const int panels = (N + NR - 1) / NR;
    const struct row_split rs = equal_chunks(M, MC, MR);
    const int mcr = rs.rows;
    const int64_t panel_bytes = (int64_t)(K / 2) * DOT_STEP_BYTES;
#pragma omp parallel num_threads(num_threads)
    {
        struct running_best bests; /* this thread's rows of chunk `in_chunk` */
        float c[MR * NR] __attribute__((aligned(64)));
        struct warm_cursor none = {NULL, 0, 0};
        int in_chunk = -1;
        const int64_t items = (int64_t)rs.chunks * panels, nt = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t end = items * (me + 1) / nt;
        for (int64_t it = items * me / nt; it < end; it++) {
            const int mc = (int)(it / panels), p = (int)(it % panels);
            const int m_end = (mc + 1) * mcr < M ? (mc + 1) * mcr : M;
            const int ncols = N - p * NR < NR ? N - p * NR : NR;
            const uint8_t *panel = blocks + (int64_t)p * panel_bytes;
            if (mc != in_chunk) {
                if (in_chunk >= 0)
                    flush_bests(&bests, in_chunk * mcr, mcr, best, (int)me);
                in_chunk = mc;
                reset_bests(&bests, m_end - mc * mcr);
            }
            const int num_tiles = (m_end - mc * mcr + MR - 1) / MR;
            const int prefetch = it + 1 < end && p + 1 < panels && panel_bytes <= PREFETCH_MAX_PANEL;
            const int share = prefetch ? (int)(panel_bytes / 64 / num_tiles) : 0;
            const char *next = (const char *)(panel + panel_bytes);
            for (int m = mc * mcr, t = 0; m < m_end; m += MR, t++) {
                const int mr = m_end - m < MR ? m_end - m : MR;
                DOT_NAME(tile_rows)(mr, c, NR, a + m * lda, lda, panel, bias ? bias + p * NR : 0, K, ncols,
                                    next + (int64_t)t * share * 64, share, &none, 0, 0);
                fold_tile(&bests, m - mc * mcr, c, mr, ncols, p * NR);
            }
        }
        if (in_chunk >= 0)
            flush_bests(&bests, in_chunk * mcr, (in_chunk + 1) * mcr < M ? mcr : M - in_chunk * mcr, best, (int)me);
    }
}

#ifdef __AVX512BW__
/* SwiGLU over the gate/up GEMM (packed_gemm_bf16_dot_swiglu): out[M, I] =
 * bf16(silu(g) * u), [g | u] = A @ W^T for the gate/up weight's BF16 panels
 * (N = 2 I, I a multiple of NR, so gate panel p pairs with up panel p + I/NR).
 *
 * Why: unfused, a prefill chunk's gate/up product is written as float32
 * [M, 2 I] (25 MB a layer at 2,048 rows of the embedded model), read back by
 * silu_mul_f32, whose float32 output is read again to be rounded for the
 * down GEMM. Here each row tile's two products land in a buffer on the stack
 * and leave as bf16 while still in L1. The products are the GEMM's own tiles,
 * silu(g) * u is silu_mul_f32's arithmetic (exp512.h's silu512), and the
 * rounding is torch's (bf16.h): the unfused path's result bit for bit (but
 * for a NaN's pattern: bf16.h writes 0x7FC0, torch's vector conversion its
 * own, 0xFFFF for the NaNs measured).
 *
 * Work items are (row chunk, panel pair), half the plain GEMM's (row chunk,
 * panel) for the same rows: where that leaves fewer than two a thread, the
 * rows are cut into smaller chunks (whole tiles; each row's outputs are one
 * tile's whatever the chunk, so the bits do not change). Spans to warm are
 * spread over the tiles as gemm spreads them. */
static DOT_TARGET void DOT_NAME(swiglu)(uint16_t *out, int64_t ldo, const uint16_t *a, int64_t lda,
                                        const uint8_t *blocks, int M, int I, int K, int num_threads,
                                        const char *const *spans, int64_t num_spans, int64_t span_bytes)
{
    const int pairs = I / NR;
    int chunk_rows = MC;
    while (chunk_rows > MR && (int64_t)((M + chunk_rows - 1) / chunk_rows) * pairs < 2 * (int64_t)num_threads)
        chunk_rows /= 2;
    const struct row_split rs = equal_chunks(M, chunk_rows, MR);
    const int64_t panel_bytes = (int64_t)(K / 2) * DOT_STEP_BYTES;
#pragma omp parallel num_threads(num_threads)
    {
        float g[MR * NR] __attribute__((aligned(64))), u[MR * NR] __attribute__((aligned(64)));
        const int64_t items = (int64_t)rs.chunks * pairs, nt = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t begin = items * me / nt, end = items * (me + 1) / nt;
        const int64_t first_span = num_spans * me / nt, my_spans = num_spans * (me + 1) / nt - first_span;
        struct warm_cursor warm = {spans + first_span, 0, span_bytes};
        const int64_t warm_total = my_spans * ((span_bytes + 63) / 64);
        int64_t my_tiles = 0, tiles_done = 0, warmed = 0;
        for (int64_t it = begin; it < end && warm_total; it++) {
            const int mc = (int)(it / pairs), m_end = (mc + 1) * rs.rows < M ? (mc + 1) * rs.rows : M;
            my_tiles += 2 * ((m_end - mc * rs.rows + MR - 1) / MR);
        }
        for (int64_t it = begin; it < end; it++) {
            const int mc = (int)(it / pairs), p = (int)(it % pairs);
            const int m_end = (mc + 1) * rs.rows < M ? (mc + 1) * rs.rows : M;
            const uint8_t *gate = blocks + (int64_t)p * panel_bytes, *up = gate + (int64_t)pairs * panel_bytes;
            /* The next pair's panels, prefetched over this pair's tiles as
             * gemm does the next panel (at 64 rows, from DRAM: 0.87x without). */
            const int num_tiles = (m_end - mc * rs.rows + MR - 1) / MR;
            const int prefetch = it + 1 < end && p + 1 < pairs && panel_bytes <= PREFETCH_MAX_PANEL;
            const int share = prefetch ? (int)(panel_bytes / 64 / num_tiles) : 0;
            for (int m = mc * rs.rows, t = 0; m < m_end; m += MR, t++) {
                const int mr = m_end - m < MR ? m_end - m : MR;
                for (int half = 0; half < 2; half++) {
                    const uint8_t *panel = half ? up : gate;
                    const int warm_lines = warm_total ? (int)(warm_total * ++tiles_done / my_tiles - warmed) : 0;
                    warmed += warm_lines;
                    DOT_NAME(tile_rows)(mr, half ? u : g, NR, a + m * lda, lda, panel, NULL, K, NR,
                                        (const char *)(panel + panel_bytes) + (int64_t)t * share * 64, share, &warm,
                                        warm_lines, 0);
                }
                for (int i = 0; i < mr; i++)
                    for (int j = 0; j < NV; j++) {
                        const __m512 gv = _mm512_load_ps(g + i * NR + 16 * j), uv = _mm512_load_ps(u + i * NR + 16 * j);
                        _mm256_storeu_si256((__m256i *)(out + (int64_t)(m + i) * ldo + p * NR + 16 * j),
                                            bf16_round(_mm512_mul_ps(silu512(gv), uv)));
                    }
            }
        }
    }
}
#endif
