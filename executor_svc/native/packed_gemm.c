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
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#ifdef __AVX512F__
#include <immintrin.h>

#define NV 3           /* zmm vectors per panel row */
#define NR (16 * NV)   /* output columns per panel */
#define MR 8           /* rows per register tile */
#define MC 256         /* rows per chunk sharing one pass over the weights */
#define PREFETCH_K 8   /* prefetch the panel this many k steps ahead */
#define PREFETCH_MAX_PANEL (384 * 1024) /* bytes; larger panels are not prefetched ahead */
/* C at least this large: each tile first prefetches, for writing, the output
 * lines its thread's next tile (same rows, next panel) will store. A C that
 * outgrows the caches (the LM head's 64 x 49,152 logits, 12.6 MB) left every
 * tile's stores waiting on their lines' reads: 1.07x on that shape here,
 * 1.15x in the bf16 dot kernel; a C that stays in L2 gains nothing and
 * loses up to 7% to the extra instructions (docs/optimization_log.md). */
#define PREFETCH_OUT_MIN_BYTES (4 << 20)

/* That prefetch: the NR columns after c_out in each of mr rows, for writing. */
static inline void prefetch_next_outputs(const float *c_out, int64_t ldc, int mr)
{
    for (int i = 0; i < mr; i++)
        for (int b = 0; b < NR * 4; b += 64)
            __builtin_prefetch((const char *)(c_out + i * ldc + NR) + b, 1, 3);
}

/* M rows cut into equal chunks of at most max_rows (>= tile_rows) rows,
 * each a whole number of tile_rows-row tiles (the last one may be shorter).
 * Threads take equal runs of (chunk, panel) items, so equal chunks are what
 * makes those runs equal work: cut at MC = 256, 2,050 rows left one of two
 * threads 1,152 rows of work and the other 898. */
struct row_split {
    int chunks, rows; /* rows per chunk; chunks * rows >= M > (chunks - 1) * rows */
};

static inline struct row_split equal_chunks(int M, int max_rows, int tile_rows)
{
    if (M <= 0)
        return (struct row_split){0, tile_rows};
    const int n = (M + max_rows - 1) / max_rows, rows = ((M + n - 1) / n + tile_rows - 1) / tile_rows * tile_rows;
    return (struct row_split){(M + rows - 1) / rows, rows};
}

/* The lanes of zmm j (columns 16j .. 16j+15) that lie inside a panel's
 * first ncols columns. */
static inline __mmask16 column_mask(int ncols, int j)
{
    const int n = ncols - 16 * j;
    return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1);
}

static inline __attribute__((always_inline)) void tile(
    int mr, float *c_out, int64_t ldc, const float *a, int64_t lda, const float *panel, const float *bias,
    int K, int ncols, const char *pf, int pf_lines, int accumulate)
{
    /* ncols < NR only in the last panel: masks keep bias reads and C writes inside N. */
    __mmask16 mask[NV];
    for (int j = 0; j < NV; j++)
        mask[j] = column_mask(ncols, j);
    __m512 acc[MR][NV];
    int pf_err = 0;
    /* accumulate: C already holds the sum over earlier k (the block path below). */
    for (int j = 0; j < NV; j++) {
        __m512 init = bias ? _mm512_maskz_loadu_ps(mask[j], bias + 16 * j) : _mm512_setzero_ps();
        for (int i = 0; i < mr; i++)
            acc[i][j] = accumulate ? _mm512_maskz_loadu_ps(mask[j], c_out + i * ldc + 16 * j) : init;
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
                      const float *bias, int K, int ncols, const char *pf, int pf_lines, int accumulate)
{
    switch (mr) {
    case 8: tile(8, c_out, ldc, a, lda, panel, bias, K, ncols, pf, pf_lines, accumulate); break;
    case 7: tile(7, c_out, ldc, a, lda, panel, bias, K, ncols, pf, pf_lines, accumulate); break;
    case 6: tile(6, c_out, ldc, a, lda, panel, bias, K, ncols, pf, pf_lines, accumulate); break;
    case 5: tile(5, c_out, ldc, a, lda, panel, bias, K, ncols, pf, pf_lines, accumulate); break;
    case 4: tile(4, c_out, ldc, a, lda, panel, bias, K, ncols, pf, pf_lines, accumulate); break;
    case 3: tile(3, c_out, ldc, a, lda, panel, bias, K, ncols, pf, pf_lines, accumulate); break;
    case 2: tile(2, c_out, ldc, a, lda, panel, bias, K, ncols, pf, pf_lines, accumulate); break;
    default: tile(1, c_out, ldc, a, lda, panel, bias, K, ncols, pf, pf_lines, accumulate); break;
    }
}

int packed_gemm_panel_width(void) { return NR; }

/* Returns 0; -1 if this build has no AVX-512 kernel (see below). */
int packed_gemm(float *c, int64_t ldc, const float *a, int64_t lda, const float *packed, const float *bias,
                int M, int N, int K, int num_threads)
{
    const int panels = (N + NR - 1) / NR;
    const struct row_split rs = equal_chunks(M, MC, MR);
    const int mcr = rs.rows, chunks = rs.chunks;
    const int64_t panel_bytes = (int64_t)K * NR * 4;
    const int pf_out = (int64_t)M * N * (int64_t)sizeof(float) >= PREFETCH_OUT_MIN_BYTES;
    /* Each thread takes one contiguous run of the (row chunk, panel) pairs,
     * as a static schedule would, but knows where its run ends: the panel
     * after its last one belongs to another thread, which reads it itself. */
#pragma omp parallel num_threads(num_threads)
    {
        const int64_t items = (int64_t)chunks * panels, nt = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t begin = items * me / nt, end = items * (me + 1) / nt;
        for (int64_t it = begin; it < end; it++) {
            const int mc = (int)(it / panels), p = (int)(it % panels);
            const int m_end = (mc + 1) * mcr < M ? (mc + 1) * mcr : M;
            const int ncols = N - p * NR < NR ? N - p * NR : NR;
            const float *panel = packed + (int64_t)p * K * NR;
            const float *bias_p = bias ? bias + p * NR : 0;
            /* The next panel's lines, shared out over this chunk's row tiles. */
            const int num_tiles = (m_end - mc * mcr + MR - 1) / MR;
            const int prefetch = it + 1 < end && p + 1 < panels && panel_bytes <= PREFETCH_MAX_PANEL;
            const int share = prefetch ? (int)(panel_bytes / 64 / num_tiles) : 0;
            const char *next = (const char *)(panel + (int64_t)K * NR);
            for (int m = mc * mcr, t = 0; m < m_end; m += MR, t++) {
                const int mr = m_end - m < MR ? m_end - m : MR;
                if (pf_out)
                    prefetch_next_outputs(c + m * ldc + p * NR, ldc, mr);
                tile_rows(mr, c + m * ldc + p * NR, ldc, a + m * lda, lda, panel, bias_p, K, ncols,
                          next + (int64_t)t * share * 64, share, 0);
            }
        }
    }
    return 0;
}

/* Weights kept in their GGUF blocks (Q4_1, Q8_0: 32 consecutive k of one
 * output column share a float16 scale, and for Q4_1 a float16 minimum), or
 * as bfloat16 in blocks of 32 k, regrouped at load so that one block of one
 * panel is contiguous:
 *
 *     Q4_1 (960 bytes):  f16 d[48] | f16 m[48] | u8 q[4][48][4]
 *                        q[g][c][i] = code(k = 4g + i) | code(k = 4g + i + 16) << 4
 *     Q8_0 (1632 bytes): f16 d[48] | i8 q[8][48][4]
 *                        q[g][c][i] = code(k = 4g + i)
 *     BF16 (3072 bytes): bf16 w[16][48][2]
 *                        w[s][c][i] = weight of column c at k = 2s + i
 *
 * Each format keeps consecutive k of one column side by side in one 32-bit
 * lane (4 codes, or 2 bfloat16): one 64-byte load is 16 columns x 4 k (8 k
 * for Q4_1's two nibbles), the operand order of the dot-product kernels,
 * which read the same blocks (VPDPBUSD over int8 activations,
 * int8_blocks.h; VDPBF16PS, bf16_dot_gemm.h). The float32 paths below take
 * code k out of byte k % 4 of each lane with a shift (and a mask, or an
 * arithmetic shift for Q8_0's signed codes).
 *
 * A bfloat16 weight is the top half of a float32 one, so widening it is
 * exact and the product is float32 arithmetic on bfloat16 weights: what a
 * native bf16 GEMM computes (products exact, sums in float32), on CPUs whose
 * AVX-512 has no bf16 instructions (--dtype bfloat16, model.py).
 *
 * w = d * code + m (Q4_1) or d * code (Q8_0); d * code is exact in float32
 * (11 x 4 or 11 x 8 significant bits), so one FMA rounds once, as the
 * loader's (d * code) + m does: the kernel multiplies by the very weights a
 * float32 load holds, in the same order, and its outputs are the float32
 * path's bit for bit, while a decode step reads 5 or 8.5 bits per weight
 * (20- or 34-byte blocks of 32) from DRAM instead of 32.
 *
 * The panel is expanded KC rows of k at a time into a float32 buffer that
 * stays in L1 (KC x NR x 4 = 12 KB), and every row tile of the chunk passes
 * over that slice before the next is expanded; the tiles keep their partial
 * sums in a contiguous NR-wide buffer between slices (the same FMA chain,
 * stored and reloaded), copied into C after the last slice. While a slice
 * of panel p is expanded, the same slice of panel p + 1 is prefetched, so
 * the DRAM stream runs one panel ahead:
 *
 *     panel p:   [expand k 0..63 | tiles] [expand k 64..127 | tiles] ...
 *     panel p+1:  prefetch 0..63           prefetch 64..127           ...
 *
 * Up to FUSED_MAX_ROWS rows skip the buffer (fused_blocks.h): there its
 * store and reload cost more than the arithmetic, so each block is widened
 * in registers straight into the FMAs, same chain, same bits.
 */
#define QK 32          /* k per GGUF block */
#define KC (2 * QK)    /* k per expanded slice */
enum { FMT_Q4_1 = 1, FMT_Q8_0 = 2, FMT_BF16 = 3 };

static int64_t quant_block_bytes(int fmt)
{
    return fmt == FMT_Q4_1 ? 4 * NR + QK / 2 * NR : fmt == FMT_Q8_0 ? 2 * NR + QK * NR : 2 * QK * NR;
}

/* Byte i (0..3) of every 32-bit lane of v, zero-extended (lane_byte), or
 * moved to the lane's top byte over 24 zero bits (lane_byte_high: the int32
 * code << 24, signed as the code). One in-lane byte shuffle, on the port
 * that zero/sign-extending loads used before the codes were grouped by 4 k;
 * shifts would queue with the float conversions on the other (8 float rows
 * ran 14-25% slower that way). */
static inline __m512i lane_byte(__m512i v, int i)
{
#ifdef __AVX512BW__
    return _mm512_shuffle_epi8(v, _mm512_broadcast_i32x4(_mm_setr_epi32((int)0x80808000u + i, (int)0x80808004u + i,
                                                                         (int)0x80808008u + i, (int)0x8080800Cu + i)));
#else
    return _mm512_and_si512(_mm512_srli_epi32(v, 8 * i), _mm512_set1_epi32(0xFF));
#endif
}

static inline __m512i lane_byte_high(__m512i v, int i)
{
#ifdef __AVX512BW__
    return _mm512_shuffle_epi8(v, _mm512_broadcast_i32x4(_mm_setr_epi32((int)(0x00808080u | (unsigned)i << 24),
                                                                         (int)(0x00808080u | (unsigned)(4 + i) << 24),
                                                                         (int)(0x00808080u | (unsigned)(8 + i) << 24),
                                                                         (int)(0x00808080u | (unsigned)(12 + i) << 24))));
#else
    return _mm512_slli_epi32(_mm512_srli_epi32(v, 8 * i), 24);
#endif
}

/* A Q8_0 code comes as code << 24 (lane_byte_high): float(code << 24) is
 * code * 2^24 exactly, and (d * 2^-24) * that is d * code exactly (d has 11
 * significant bits, code 8; d * 2^-24 stays a normal float), the very value
 * d * float(code) gives. */
#define Q8_UNSHIFT 0x1p-24f

/* The weights of one block of one panel, as QK x NR float32 rows of k.
 * `pf` (or NULL): the same block of the next panel, prefetched a line every
 * third vector of output; issued together, the prefetches would fill the
 * line-fill buffers and stall the expansion until DRAM answered. */
static inline void expand_block(float *buf, const uint8_t *qp, int fmt, const char *pf)
{
    const uint16_t *scales = (const uint16_t *)qp;
    const int lines = pf ? (int)((quant_block_bytes(fmt) + 63) / 64) : 0;
    if (fmt == FMT_BF16) {
        /* 48 lines over 48 loads of 16 columns x 2 k: the even k is the low
         * half of each 32-bit lane, the odd k the high half. */
        const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
        for (int s = 0; s < QK / 2; s++)
            for (int j = 0; j < NV; j++) {
                const int v = s * NV + j;
                if (v < lines)
                    _mm_prefetch(pf + 64 * v, _MM_HINT_T0);
                const __m512i w = _mm512_loadu_si512((const void *)(qp + 64 * v));
                _mm512_store_ps(buf + 2 * s * NR + 16 * j, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
                _mm512_store_ps(buf + (2 * s + 1) * NR + 16 * j, _mm512_castsi512_ps(_mm512_and_si512(w, high)));
            }
        return;
    }
    for (int j = 0; j < NV; j++) {
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scales + 16 * j)));
        if (fmt == FMT_Q4_1) {
            const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scales + NR + 16 * j)));
            const uint8_t *q = qp + 4 * NR + 64 * j;
            /* Unrolled: k % 4 picks a constant shuffle (a variable one costs more than it moves). */
#pragma GCC unroll 16
            for (int k = 0; k < QK / 2; k++) {
                const int step = j * QK / 2 + k; /* 48 steps for 15 lines */
                if (step % 3 == 0 && step / 3 < lines)
                    _mm_prefetch(pf + 64 * (step / 3), _MM_HINT_T0);
                const __m512i v = lane_byte(_mm512_loadu_si512((const void *)(q + (k / 4) * 4 * NR)), k % 4);
                const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
                const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
                _mm512_store_ps(buf + k * NR + 16 * j, _mm512_fmadd_ps(d, lo, m));
                _mm512_store_ps(buf + (k + QK / 2) * NR + 16 * j, _mm512_fmadd_ps(d, hi, m));
            }
        } else {
            const uint8_t *q = qp + 2 * NR + 64 * j;
            const __m512 d24 = _mm512_mul_ps(d, _mm512_set1_ps(Q8_UNSHIFT));
#pragma GCC unroll 32
            for (int k = 0; k < QK; k++) {
                const int step = j * QK + k; /* 96 steps for 26 lines */
                if (step % 3 == 0 && step / 3 < lines)
                    _mm_prefetch(pf + 64 * (step / 3), _MM_HINT_T0);
                const __m512i v = _mm512_loadu_si512((const void *)(q + (k / 4) * 4 * NR));
                const __m512 code = _mm512_cvtepi32_ps(lane_byte_high(v, k % 4));
                _mm512_store_ps(buf + k * NR + 16 * j, _mm512_mul_ps(d24, code));
            }
        }
    }
}

#include "fused_blocks.h"

static void gemm_blocks(float *c, int64_t ldc, const float *a, int64_t lda, const uint8_t *blocks, int fmt,
                        const float *bias, int M, int N, int K, int num_threads)
{
    const int panels = (N + NR - 1) / NR;
    const struct row_split rs = equal_chunks(M, MC, MR);
    const int mcr = rs.rows, chunks = rs.chunks;
    const int64_t block_bytes = quant_block_bytes(fmt), panel_bytes = (int64_t)(K / QK) * block_bytes;
#pragma omp parallel num_threads(num_threads)
    {
        /* The chunk's partial sums, NR wide (C's own rows may be a multiple
         * of 4 KB apart and would then all fall into the same L1 sets), and
         * the expanded slice: 60 KB of this thread's stack. */
        float sums[MC * NR] __attribute__((aligned(64)));
        float buf[KC * NR] __attribute__((aligned(64)));
        const int64_t items = (int64_t)chunks * panels, nt = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t begin = items * me / nt, end = items * (me + 1) / nt;
        for (int64_t it = begin; it < end; it++) {
            const int mc = (int)(it / panels), p = (int)(it % panels);
            const int m0 = mc * mcr, rows = (mc + 1) * mcr < M ? mcr : M - mc * mcr;
            const int ncols = N - p * NR < NR ? N - p * NR : NR;
            const uint8_t *panel = blocks + p * panel_bytes;
            const int prefetch = it + 1 < end && p + 1 < panels;
            if (M <= FUSED_MAX_ROWS) {
                fused_rows(M, fmt, c + p * NR, ldc, a, lda, panel, bias ? bias + p * NR : 0, K, ncols,
                           prefetch ? panel_bytes : 0);
                continue;
            }
            for (int k0 = 0; k0 < K; k0 += KC) {
                const int kc = K - k0 < KC ? K - k0 : KC;
                for (int kb = k0; kb < k0 + kc; kb += QK) {
                    const uint8_t *qp = panel + (int64_t)(kb / QK) * block_bytes;
                    expand_block(buf + (kb - k0) * NR, qp, fmt, prefetch ? (const char *)qp + panel_bytes : 0);
                }
                for (int m = 0; m < rows; m += MR) {
                    const int mr = rows - m < MR ? rows - m : MR;
                    tile_rows(mr, sums + m * NR, NR, a + (m0 + m) * lda + k0, lda, buf,
                              k0 == 0 && bias ? bias + p * NR : 0, kc, ncols, 0, 0, k0 > 0);
                }
            }
            const __mmask16 tail = ncols % 16 ? (__mmask16)((1u << (ncols % 16)) - 1) : (__mmask16)0xFFFF;
            for (int m = 0; m < rows; m++)
                for (int j = 0; j < NV && 16 * j < ncols; j++)
                    _mm512_mask_storeu_ps(c + (m0 + m) * ldc + p * NR + 16 * j, 16 * j + 16 <= ncols ? 0xFFFF : tail,
                                          _mm512_load_ps(sums + m * NR + 16 * j));
        }
    }
}

int packed_gemm_quant(float *c, int64_t ldc, const float *a, int64_t lda, const uint8_t *blocks, int fmt,
                      const float *bias, int M, int N, int K, int num_threads)
{
    /* K == 0 would copy the never-written partial sums (not even the bias) into C. */
    if ((fmt != FMT_Q4_1 && fmt != FMT_Q8_0 && fmt != FMT_BF16) || K <= 0 || K % QK != 0)
        return -3;
    gemm_blocks(c, ldc, a, lda, blocks, fmt, bias, M, N, K, num_threads);
    return 0;
}

#include "row_tiles.h"
#include "int8_blocks.h"

/* 1 where this CPU runs VPDPBUSD (AVX512-VNNI): the int8 kernel's condition. */
int packed_gemm_int8_native(void) { return __builtin_cpu_supports("avx512vnni") ? 1 : 0; }

/* The int8 quantisation of rows of a [M, K] that packed_gemm_quant_int8
 * multiplies by (int8_blocks.h): q [M][K], scale and sum [M][K/32]. Returns
 * 0; -3 for a K that is not a positive multiple of 32. */
int quantize_rows_int8(int8_t *q, float *scale, float *sum, const float *a, int64_t lda, int M, int K)
{
    if (K <= 0 || K % QK != 0)
        return -3;
    int32_t *bias128 = row_scratch_bytes((size_t)M * (K / QK) * sizeof(int32_t));
    if (!bias128)
        return -1;
    quantize_rows(q, scale, sum, bias128, a, lda, M, K, 1);
    return 0;
}

/* C = A @ W^T (+ bias) over Q4_1/Q8_0 block panels, A quantised to int8 per
 * row and block of 32 k first (int8_blocks.h): llama.cpp's arithmetic, not
 * the float32 path's result. Returns 0; -2 where the CPU has no AVX512-VNNI;
 * -3 for a format other than Q4_1/Q8_0 or a K the blocks cannot hold; -1 if
 * the scratch for the quantised rows cannot be allocated. */
int packed_gemm_quant_int8(float *c, int64_t ldc, const float *a, int64_t lda, const uint8_t *blocks, int fmt,
                           const float *bias, int M, int N, int K, int num_threads)
{
    if ((fmt != FMT_Q4_1 && fmt != FMT_Q8_0) || K <= 0 || K % QK != 0)
        return -3;
    if (!packed_gemm_int8_native())
        return -2;
    if (M <= 0 || N <= 0)
        return 0;
    const int nb = K / QK;
    /* rows | q [M][K] | d, s [M][nb] | bias128 [M][nb], each 64-byte aligned */
    const size_t rows_bytes = ((size_t)M * sizeof(struct int8_row) + 63) / 64 * 64;
    const size_t q_bytes = ((size_t)M * K + 63) / 64 * 64, f_bytes = ((size_t)M * nb * 4 + 63) / 64 * 64;
    char *scratch = row_scratch_bytes(rows_bytes + q_bytes + 3 * f_bytes);
    if (!scratch)
        return -1;
    struct int8_row *x = (struct int8_row *)scratch;
    int8_t *q = (int8_t *)(scratch + rows_bytes);
    float *d = (float *)(scratch + rows_bytes + q_bytes), *s = (float *)(scratch + rows_bytes + q_bytes + f_bytes);
    int32_t *bias128 = (int32_t *)(scratch + rows_bytes + q_bytes + 2 * f_bytes);
    quantize_rows(q, d, s, bias128, a, lda, M, K, num_threads);
    for (int r = 0; r < M; r++)
        x[r] = (struct int8_row){q + (int64_t)r * K, d + (int64_t)r * nb, s + (int64_t)r * nb, bias128 + (int64_t)r * nb};
    gemm_int8(c, ldc, x, blocks, fmt, bias, M, N, K, num_threads);
    return 0;
}

/* The bf16 dot-product kernels, over the same BF16 blocks (bf16_dot_gemm.h)
 * and over Q4_1 blocks (q4_dot_gemm.h), twice: with VDPBF16PS, and with its
 * arithmetic emulated in AVX-512F. */
#include "bf16_dot.h"

#define DOT_STEP_BYTES (NR * 4) /* one k pair of one panel: 48 columns x 2 bf16 */

/* The Q4_1 kernel's in-lane byte shuffles need AVX512-BW, which every CPU
 * with AVX512-BF16 has. */
#ifdef __AVX512BW__
#define Q4DOT_TILE_ROWS 4
#include "bf16.h"
#include "exp512.h" /* silu512: SwiGLU on the dot GEMM's tiles (bf16_dot_gemm.h) */

/* One call's arguments, its activations already rounded (xb [M][K]) and
 * summed per block (xs [M][K/32]). */
struct q4_dot_call {
    float *c;
    int64_t ldc;
    const uint16_t *xb;
    const float *xs;
    const uint8_t *blocks;
    const float *bias;
    int K;
    int64_t panel_bytes;
};

/* Each row of a [M, K] rounded to bfloat16 (bf16.h: torch's rounding) into
 * xb [M][K], and each block of 32 of those values summed in float32 into
 * xs [M][K/32]: q4_dot_gemm.h's activations; rows shared out among threads
 * where there are enough of them (a prefill chunk's), each row's values the
 * same whoever computes them. */
static void bf16_rows_with_sums(uint16_t *xb, float *xs, const float *a, int64_t lda, int M, int K, int num_threads)
{
#pragma omp parallel for num_threads(num_threads) schedule(static) if (M >= 64 && num_threads > 1)
    for (int r = 0; r < M; r++)
        for (int b = 0; b < K / QK; b++) {
            const float *x = a + r * lda + b * QK;
            const __m256i lo = bf16_round(_mm512_loadu_ps(x)), hi = bf16_round(_mm512_loadu_ps(x + 16));
            _mm256_storeu_si256((__m256i *)(xb + (int64_t)r * K + b * QK), lo);
            _mm256_storeu_si256((__m256i *)(xb + (int64_t)r * K + b * QK + 16), hi);
            xs[(int64_t)r * (K / QK) + b] = _mm512_reduce_add_ps(_mm512_add_ps(bf16_widen(lo), bf16_widen(hi)));
        }
}
#endif

#define DOT_NAME(x) x##_dot_emulated
#define DOT_TARGET
#define DOT(acc, a, b) dot_emulated(acc, a, b)
#include "bf16_dot_gemm.h"
#ifdef __AVX512BW__
#include "q4_dot_gemm.h"
#endif
#undef DOT_NAME
#undef DOT_TARGET
#undef DOT

/* And with the instruction, where bf16_dot.h says this compiler builds it. */
#ifdef HAVE_NATIVE_DOT
#define DOT_NAME(x) x##_dot_native
#define DOT_TARGET DOT_NATIVE_TARGET
#define DOT(acc, a, b) DOT_NATIVE_OP(acc, a, b)
#include "bf16_dot_gemm.h"
#ifdef __AVX512BW__
#include "q4_dot_gemm.h"
#endif
#undef DOT_NAME
#undef DOT_TARGET
#undef DOT
#endif

/* Spans to warm that cannot be read: a negative count, or some without a
 * list or of no bytes (the warming entry points refuse them, -4). */
static int bad_spans(const char *const *spans, int64_t num_spans, int64_t span_bytes)
{
    return num_spans < 0 || (num_spans > 0 && (spans == NULL || span_bytes <= 0));
}

/* 1 where this build has the VDPBF16PS kernel and this CPU runs it. */
int packed_gemm_bf16_dot_native(void)
{
#ifdef HAVE_NATIVE_DOT
    return __builtin_cpu_supports("avx512bf16") ? 1 : 0;
#else
    return 0;
#endif
}

/* C = A @ W^T (+ bias) over BF16 blocks, A bfloat16 [M, K] with row stride
 * lda; `native` picks VDPBF16PS (0 = emulated). Returns 0; -2 if native is
 * asked for where packed_gemm_bf16_dot_native() is 0; -3 for a K the blocks
 * cannot hold. */
int packed_gemm_bf16_dot_warm(float *c, int64_t ldc, const uint16_t *a, int64_t lda, const uint8_t *blocks,
                              const float *bias, int M, int N, int K, int native, int num_threads,
                              const char *const *spans, int64_t num_spans, int64_t span_bytes);

int packed_gemm_bf16_dot(float *c, int64_t ldc, const uint16_t *a, int64_t lda, const uint8_t *blocks,
                         const float *bias, int M, int N, int K, int native, int num_threads)
{
    return packed_gemm_bf16_dot_warm(c, ldc, a, lda, blocks, bias, M, N, K, native, num_threads, NULL, 0, 0);
}

/* out [M, I] bfloat16 (row stride ldo) = silu(g) * u, [g | u] = A @ W^T over
 * the gate/up weight's BF16 blocks (N = 2 I), A and `native` as in
 * packed_gemm_bf16_dot: that GEMM, silu_mul_f32 and torch's rounding to
 * bfloat16, bit for bit (NaN patterns aside), in one pass (bf16_dot_gemm.h),
 * warming num_spans spans as packed_gemm_bf16_dot_warm does (none: 0).
 * Returns 0; -1 where this build has no AVX-512BW; -2 as packed_gemm_bf16_dot;
 * -3 for a K the blocks cannot hold or an I that is not whole panels; -4 as
 * packed_gemm_bf16_dot_warm. */
int packed_gemm_bf16_dot_swiglu(uint16_t *out, int64_t ldo, const uint16_t *a, int64_t lda, const uint8_t *blocks,
                                int M, int I, int K, int native, int num_threads, const char *const *spans,
                                int64_t num_spans, int64_t span_bytes)
{
#ifdef __AVX512BW__
    if (K <= 0 || K % QK != 0 || I <= 0 || I % NR != 0)
        return -3;
    if (bad_spans(spans, num_spans, span_bytes))
        return -4;
    if (native) {
        if (!packed_gemm_bf16_dot_native())
            return -2;
#ifdef HAVE_NATIVE_DOT
        swiglu_dot_native(out, ldo, a, lda, blocks, M, I, K, num_threads, spans, num_spans, span_bytes);
#endif
        return 0;
    }
    swiglu_dot_emulated(out, ldo, a, lda, blocks, M, I, K, num_threads, spans, num_spans, span_bytes);
    return 0;
#else
    (void)out; (void)ldo; (void)a; (void)lda; (void)blocks; (void)M; (void)I; (void)K; (void)native;
    (void)num_threads; (void)spans; (void)num_spans; (void)span_bytes;
    return -1;
#endif
}

/* packed_gemm_bf16_dot that also prefetches num_spans spans of span_bytes
 * bytes each, spans[i] the first (bf16_dot_gemm.h: warming), into the cache
 * while it computes; the result is packed_gemm_bf16_dot's, bit for bit.
 * Returns as it does, or -4 (nothing run) for a negative num_spans, or spans
 * to warm without a list or with span_bytes <= 0. */
int packed_gemm_bf16_dot_warm(float *c, int64_t ldc, const uint16_t *a, int64_t lda, const uint8_t *blocks,
                              const float *bias, int M, int N, int K, int native, int num_threads,
                              const char *const *spans, int64_t num_spans, int64_t span_bytes)
{
    if (K <= 0 || K % QK != 0)
        return -3;
    if (bad_spans(spans, num_spans, span_bytes))
        return -4;
    if (native) {
        if (!packed_gemm_bf16_dot_native())
            return -2;
#ifdef HAVE_NATIVE_DOT
        gemm_dot_native(c, ldc, a, lda, blocks, bias, M, N, K, num_threads, spans, num_spans, span_bytes);
#endif
        return 0;
    }
    gemm_dot_emulated(c, ldc, a, lda, blocks, bias, M, N, K, num_threads, spans, num_spans, span_bytes);
    return 0;
}

/* out[r] = the first index of row r's largest value in C = A @ W^T (+ bias),
 * or of its first NaN (argmax_rows_f32's answer over packed_gemm_bf16_dot's
 * C, bit for bit), without writing C (bf16_dot_gemm.h: argmax). A, W and
 * `native` as in packed_gemm_bf16_dot. Returns 0; -2 as it does; -3 for a K
 * the blocks cannot hold, M < 0 or N < 1; -5 if the threads' bests could
 * not be allocated. */
int packed_gemm_bf16_dot_argmax(int64_t *out, const uint16_t *a, int64_t lda, const uint8_t *blocks,
                                const float *bias, int M, int N, int K, int native, int num_threads)
{
    if (K <= 0 || K % QK != 0 || M < 0 || N < 1)
        return -3;
    if (native && !packed_gemm_bf16_dot_native())
        return -2;
    if (M == 0)
        return 0;
    const int slots = num_threads > 0 ? num_threads : 1;
    struct thread_bests best = {malloc(sizeof(float) * (size_t)M * (size_t)slots),
                              malloc(sizeof(int32_t) * (size_t)M * (size_t)slots), slots};
    if (!best.value || !best.index) {
        free(best.value);
        free(best.index);
        return -5;
    }
    for (int64_t i = 0; i < (int64_t)M * slots; i++) /* a thread that saw none of a row: never taken below */
        best.value[i] = -INFINITY;
#ifdef HAVE_NATIVE_DOT
    if (native)
        gemm_argmax_dot_native(a, lda, blocks, bias, M, N, K, slots, &best);
    else
#endif
        gemm_argmax_dot_emulated(a, lda, blocks, bias, M, N, K, slots, &best);
    /* Threads took runs of columns in increasing order: the first NaN met is
     * the row's first; a strict > keeps the earliest of equal bests; a row of
     * only -inf answers 0. */
    for (int r = 0; r < M; r++) {
        const float *v = best.value + (int64_t)r * slots;
        const int32_t *ix = best.index + (int64_t)r * slots;
        float top = -INFINITY;
        int64_t at = 0;
        for (int t = 0; t < slots; t++) {
            if (v[t] != v[t]) {
                at = ix[t];
                break;
            }
            if (v[t] > top) {
                top = v[t];
                at = ix[t];
            }
        }
        out[r] = at;
    }
    free(best.value);
    free(best.index);
    return 0;
}

/* C = bf16(A) @ W^T (+ bias) over Q4_1 block panels (q4_dot_gemm.h), A
 * float32 [M, K] with row stride lda, rounded to bfloat16 here; `native`
 * picks VDPBF16PS (0 = emulated). Returns 0; -2 if native is asked for where
 * packed_gemm_bf16_dot_native() is 0, or the build lacks AVX512-BW; -3 for
 * a format other than Q4_1 or a K the blocks cannot hold; -1 if the scratch
 * for the rounded rows cannot be allocated. */
int packed_gemm_quant_bf16_dot(float *c, int64_t ldc, const float *a, int64_t lda, const uint8_t *blocks, int fmt,
                               const float *bias, int M, int N, int K, int native, int num_threads)
{
    if (fmt != FMT_Q4_1 || K <= 0 || K % QK != 0)
        return -3;
#ifdef __AVX512BW__
    if (native && !packed_gemm_bf16_dot_native())
        return -2;
    if (M <= 0 || N <= 0)
        return 0;
    const size_t xb_bytes = ((size_t)M * K * sizeof(uint16_t) + 63) / 64 * 64;
    char *scratch = row_scratch_bytes(xb_bytes + (size_t)M * (K / QK) * sizeof(float));
    if (!scratch)
        return -1;
    uint16_t *xb = (uint16_t *)scratch;
    float *xs = (float *)(scratch + xb_bytes);
    bf16_rows_with_sums(xb, xs, a, lda, M, K, num_threads);
    const struct q4_dot_call call = {c, ldc, xb, xs, blocks, bias, K, (int64_t)(K / QK) * quant_block_bytes(FMT_Q4_1)};
#ifdef HAVE_NATIVE_DOT
    if (native) {
        q4_gemm_dot_native(&call, M, N, num_threads);
        return 0;
    }
#endif
    q4_gemm_dot_emulated(&call, M, N, num_threads);
    return 0;
#else
    (void)c; (void)ldc; (void)a; (void)lda; (void)blocks; (void)bias; (void)M; (void)N; (void)native;
    (void)num_threads;
    return -2; /* K is checked above */
#endif
}

#else /* no AVX-512: the loader sees a panel width of 0 and keeps torch's GEMM */

int packed_gemm_panel_width(void) { return 0; }

int packed_gemm(float *c, int64_t ldc, const float *a, int64_t lda, const float *packed, const float *bias,
                int M, int N, int K, int num_threads)
{
    (void)c; (void)ldc; (void)a; (void)lda; (void)packed; (void)bias; (void)M; (void)N; (void)K; (void)num_threads;
    return -1;
}

int packed_gemm_quant(float *c, int64_t ldc, const float *a, int64_t lda, const uint8_t *blocks, int fmt,
                      const float *bias, int M, int N, int K, int num_threads)
{
    (void)c; (void)ldc; (void)a; (void)lda; (void)blocks; (void)fmt; (void)bias; (void)M; (void)N; (void)K;
    (void)num_threads;
    return -1;
}

int packed_gemm_bf16_dot_native(void) { return 0; }

int packed_gemm_int8_native(void) { return 0; }

int quantize_rows_int8(int8_t *q, float *scale, float *sum, const float *a, int64_t lda, int M, int K)
{
    (void)q; (void)scale; (void)sum; (void)a; (void)lda; (void)M; (void)K;
    return -1;
}

int packed_gemm_quant_int8(float *c, int64_t ldc, const float *a, int64_t lda, const uint8_t *blocks, int fmt,
                           const float *bias, int M, int N, int K, int num_threads)
{
    (void)c; (void)ldc; (void)a; (void)lda; (void)blocks; (void)fmt; (void)bias; (void)M; (void)N; (void)K;
    (void)num_threads;
    return -1;
}

int packed_gemm_bf16_dot(float *c, int64_t ldc, const uint16_t *a, int64_t lda, const uint8_t *blocks,
                         const float *bias, int M, int N, int K, int native, int num_threads)
{
    (void)c; (void)ldc; (void)a; (void)lda; (void)blocks; (void)bias; (void)M; (void)N; (void)K; (void)native;
    (void)num_threads;
    return -1;
}

int packed_gemm_bf16_dot_warm(float *c, int64_t ldc, const uint16_t *a, int64_t lda, const uint8_t *blocks,
                              const float *bias, int M, int N, int K, int native, int num_threads,
                              const char *const *spans, int64_t num_spans, int64_t span_bytes)
{
    (void)c; (void)ldc; (void)a; (void)lda; (void)blocks; (void)bias; (void)M; (void)N; (void)K; (void)native;
    (void)num_threads; (void)spans; (void)num_spans; (void)span_bytes;
    return -1;
}

int packed_gemm_quant_bf16_dot(float *c, int64_t ldc, const float *a, int64_t lda, const uint8_t *blocks, int fmt,
                               const float *bias, int M, int N, int K, int native, int num_threads)
{
    (void)c; (void)ldc; (void)a; (void)lda; (void)blocks; (void)fmt; (void)bias; (void)M; (void)N; (void)K;
    (void)native; (void)num_threads;
    return -1;
}

int packed_gemm_bf16_dot_argmax(int64_t *out, const uint16_t *a, int64_t lda, const uint8_t *blocks,
                                const float *bias, int M, int N, int K, int native, int num_threads)
{
    (void)out; (void)a; (void)lda; (void)blocks; (void)bias; (void)M; (void)N; (void)K; (void)native;
    (void)num_threads;
    return -1;
}

int packed_gemm_bf16_dot_swiglu(uint16_t *out, int64_t ldo, const uint16_t *a, int64_t lda, const uint8_t *blocks,
                                int M, int I, int K, int native, int num_threads, const char *const *spans,
                                int64_t num_spans, int64_t span_bytes)
{
    (void)out; (void)ldo; (void)a; (void)lda; (void)blocks; (void)M; (void)I; (void)K; (void)native;
    (void)num_threads; (void)spans; (void)num_spans; (void)span_bytes;
    return -1;
}

#endif
