/* float32 GEMM for CPUs with AVX-512, against weights packed once at load.
 *
 *     C[M, N] = A[M, K] @ W[N, K]^T (+ bias[N])
 *
 * Why not MKL: a decode step multiplies 8-256 rows by weights that are far
 * larger than the caches, and MKL re-packs its B operand on every call; for
 * so few rows that packing costs about as much as the arithmetic. Packing
 * once, at load, into the order this kernel reads (and prefetching the next
 * panel, below) gives 1.2-1.5x at 8-256 rows; past one MC-row chunk MKL is
 * as fast, so packed_linear.py sends it only up to MC rows
 * (docs/benchmarks.md).
 *
 * Packed layout: W is cut into panels of NR = 48 output columns (three zmm
 * registers); panel p holds W[48p .. 48p+47][0 .. K-1] transposed, k-major:
 *
 *     packed[p][k][c] = W[48p + c][k]      (zero where 48p + c >= N)
 *
 * so one k step of one panel is three aligned 64-byte loads, read in order.
 *
 * Micro-kernel: an MR x NR = 8 x 48 tile of C lives in 24 zmm accumulators;
 * each k step loads the panel's 48 weights once and broadcasts 8 values of A
 * into 24 FMAs. The B panel (K x 192 bytes) stays in L2 while all row tiles
 * of a chunk of MC rows pass over it, so each weight crosses from DRAM once
 * per chunk. Threads split the (row chunk, panel) pairs statically.
 *
 * Weights come cold from DRAM (a step reads each once), and the hardware
 * prefetcher runs too few lines ahead to hide DRAM latency: left to it, the
 * first row tile over a panel waits on memory while the others compute, so
 * the two add up instead of overlapping. So while the row tiles pass over
 * panel p, they prefetch panel p + 1 when the same thread computes it next,
 * each tile a 1/T share of its lines spread evenly over its K steps:
 *
 *     panel p:    tile 0 | tile 1 | ... | tile T-1     (compute, from L2)
 *     panel p+1:  1/T    | 1/T    | ... | 1/T          (prefetch, from DRAM)
 *
 * Two panels must fit in L2 beside the row tiles' A rows, so panels over
 * PREFETCH_MAX_PANEL bytes (K > 2048) are left to the hardware prefetcher:
 * untried there, and a prefetch that evicts the current panel would cost
 * more than it hides.
 */
#include <omp.h>
#include <stdint.h>

#ifdef __AVX512F__
#include <immintrin.h>

#define NV 3           /* zmm vectors per panel row */
#define NR (16 * NV)   /* output columns per panel */
#define MR 8           /* rows per register tile */
#define MC 256         /* rows per chunk sharing one pass over the weights */
#define PREFETCH_K 8   /* prefetch the panel this many k steps ahead */
#define PREFETCH_MAX_PANEL (384 * 1024) /* bytes; larger panels are not prefetched ahead */

static inline __attribute__((always_inline)) void tile(
    int mr, float *c_out, int64_t ldc, const float *a, int64_t lda, const float *panel, const float *bias,
    int K, int ncols, const char *pf, int pf_lines)
{
    /* ncols < NR only in the last panel: masks keep bias reads and C writes inside N. */
    __mmask16 mask[NV];
    for (int j = 0; j < NV; j++) {
        int n = ncols - 16 * j;
        mask[j] = n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1);
    }
    __m512 acc[MR][NV];
    int pf_err = 0;
    for (int j = 0; j < NV; j++) {
        __m512 init = bias ? _mm512_maskz_loadu_ps(mask[j], bias + 16 * j) : _mm512_setzero_ps();
        for (int i = 0; i < mr; i++)
            acc[i][j] = init;
    }
#pragma GCC unroll 4
    for (int k = 0; k < K; k++) {
        const float *w = panel + (int64_t)k * NR;
        _mm_prefetch((const char *)(w + PREFETCH_K * NR), _MM_HINT_T0);
        /* pf_lines lines of the next panel over K steps, Bresenham style (a
         * division per step would cost more than the prefetches save). */
        for (pf_err += pf_lines; pf_err >= K; pf_err -= K, pf += 64)
            _mm_prefetch(pf, _MM_HINT_T0);
        __m512 wv[NV];
        for (int j = 0; j < NV; j++)
            wv[j] = _mm512_loadu_ps(w + 16 * j);
        for (int i = 0; i < mr; i++) {
            __m512 x = _mm512_set1_ps(a[i * lda + k]);
            for (int j = 0; j < NV; j++)
                acc[i][j] = _mm512_fmadd_ps(x, wv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < NV; j++)
            _mm512_mask_storeu_ps(c_out + i * ldc + 16 * j, mask[j], acc[i][j]);
}

/* One instance per row count, so every tile's loops unroll and its
 * accumulators stay in registers. */
static void tile_rows(int mr, float *c_out, int64_t ldc, const float *a, int64_t lda, const float *panel,
                      const float *bias, int K, int ncols, const char *pf, int pf_lines)
{
    switch (mr) {
    case 8: tile(8, c_out, ldc, a, lda, panel, bias, K, ncols, pf, pf_lines); break;
    case 7: tile(7, c_out, ldc, a, lda, panel, bias, K, ncols, pf, pf_lines); break;
    case 6: tile(6, c_out, ldc, a, lda, panel, bias, K, ncols, pf, pf_lines); break;
    case 5: tile(5, c_out, ldc, a, lda, panel, bias, K, ncols, pf, pf_lines); break;
    case 4: tile(4, c_out, ldc, a, lda, panel, bias, K, ncols, pf, pf_lines); break;
    case 3: tile(3, c_out, ldc, a, lda, panel, bias, K, ncols, pf, pf_lines); break;
    case 2: tile(2, c_out, ldc, a, lda, panel, bias, K, ncols, pf, pf_lines); break;
    default: tile(1, c_out, ldc, a, lda, panel, bias, K, ncols, pf, pf_lines); break;
    }
}

int packed_gemm_panel_width(void) { return NR; }

/* Returns 0; -1 if this build has no AVX-512 kernel (see below). */
int packed_gemm(float *c, int64_t ldc, const float *a, int64_t lda, const float *packed, const float *bias,
                int M, int N, int K, int num_threads)
{
    const int panels = (N + NR - 1) / NR;
    const int chunks = (M + MC - 1) / MC;
    const int64_t panel_bytes = (int64_t)K * NR * 4;
    /* Each thread takes one contiguous run of the (row chunk, panel) pairs,
     * as a static schedule would, but knows where its run ends: the panel
     * after its last one belongs to another thread, which reads it itself. */
#pragma omp parallel num_threads(num_threads)
    {
        const int64_t items = (int64_t)chunks * panels, nt = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t begin = items * me / nt, end = items * (me + 1) / nt;
        for (int64_t it = begin; it < end; it++) {
            const int mc = (int)(it / panels), p = (int)(it % panels);
            const int m_end = (mc + 1) * MC < M ? (mc + 1) * MC : M;
            const int ncols = N - p * NR < NR ? N - p * NR : NR;
            const float *panel = packed + (int64_t)p * K * NR;
            const float *bias_p = bias ? bias + p * NR : 0;
            /* The next panel's lines, shared out over this chunk's row tiles. */
            const int num_tiles = (m_end - mc * MC + MR - 1) / MR;
            const int prefetch = it + 1 < end && p + 1 < panels && panel_bytes <= PREFETCH_MAX_PANEL;
            const int share = prefetch ? (int)(panel_bytes / 64 / num_tiles) : 0;
            const char *next = (const char *)(panel + (int64_t)K * NR);
            for (int m = mc * MC, t = 0; m < m_end; m += MR, t++) {
                const int mr = m_end - m < MR ? m_end - m : MR;
                tile_rows(mr, c + m * ldc + p * NR, ldc, a + m * lda, lda, panel, bias_p, K, ncols,
                          next + (int64_t)t * share * 64, share);
            }
        }
    }
    return 0;
}

#else /* no AVX-512: the loader sees a panel width of 0 and keeps torch's GEMM */

int packed_gemm_panel_width(void) { return 0; }

int packed_gemm(float *c, int64_t ldc, const float *a, int64_t lda, const float *packed, const float *bias,
                int M, int N, int K, int num_threads)
{
    (void)c; (void)ldc; (void)a; (void)lda; (void)packed; (void)bias; (void)M; (void)N; (void)K; (void)num_threads;
    return -1;
}

#endif
