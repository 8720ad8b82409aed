/* What the row-tiled block kernels share (int8_blocks.h, q4_dot_gemm.h):
 * rows in chunks that stay in L2, the work items threads take (one driver,
 * each kernel's tile behind a function pointer: one call per tile and
 * panel), and the per-thread scratch for a call's converted activation rows. Included once
 * by packed_gemm.c, after the block layout. */

/* Activation bytes (rows x their bytes per row) one pass over the panels
 * takes: a quarter of a 1-2 MB L2, beside the panel and the C tile rows. */
#define ROW_CHUNK_BYTES (256 * 1024)

/* Rows in equal chunks (whole tiles) of at most ~ROW_CHUNK_BYTES of
 * activations, each passed over the panels in turn, so that a chunk stays
 * in L2 while the panels stream past it. */
static struct row_split split_rows(int M, int64_t row_bytes, int tile_rows)
{
    const int fit = (int)(ROW_CHUNK_BYTES / row_bytes);
    return equal_chunks(M, fit > tile_rows ? fit : tile_rows, tile_rows);
}

/* One tile of rows [m, m + mr) times panel p, whose first `ncols` columns
 * lie inside N; `pf_ahead` (bytes, or 0) says where the next panel this
 * thread computes lies, for the tile to prefetch as it reads. `call` is the
 * kernel's own arguments. */
typedef void (*row_tile_fn)(const void *call, int m, int mr, int64_t p, int ncols, int64_t pf_ahead);

/* Every tile of M rows (`tile_rows` at a time, `row_bytes` of activations
 * each) times the panels of N columns (`panel_bytes` each), over threads.
 *
 * Work items are (chunk, panel). With panels enough for every thread, a
 * thread takes its share of the panels for every chunk (as gemm_blocks
 * does: its weights read once, and kept in L2 for the next chunk where they
 * fit); with fewer panels than twice the threads (a narrow weight on many
 * cores), the items are split chunk by chunk instead, so that no thread
 * idles. The first row tile of an item brings its panel in: it prefetches
 * the next item's panel when that is the next in memory. Every output is one
 * tile's, so neither the chunks nor the threads change a result. */
static void for_each_row_tile(const void *call, row_tile_fn tile, int M, int N, int64_t row_bytes, int tile_rows,
                              int64_t panel_bytes, int num_threads)
{
    const int panels = (N + NR - 1) / NR;
    const struct row_split rs = split_rows(M, row_bytes, tile_rows);
#pragma omp parallel num_threads(num_threads)
    {
        const int64_t nt = omp_get_num_threads(), me = omp_get_thread_num();
        const int by_panel = panels >= 2 * nt;
        const int64_t share = by_panel ? panels : (int64_t)rs.chunks * panels;
        const int64_t begin = share * me / nt, end = share * (me + 1) / nt;
        for (int ch = 0; ch < (by_panel ? rs.chunks : 1); ch++)
            for (int64_t i = begin; i < end; i++) {
                const int64_t p = by_panel ? i : i % panels;
                const int m0 = (by_panel ? ch : (int)(i / panels)) * rs.rows, m1 = M - m0 < rs.rows ? M : m0 + rs.rows;
                const int ncols = N - p * NR < NR ? N - p * NR : NR;
                for (int m = m0; m < m1; m += tile_rows) {
                    const int prefetch = m == m0 && i + 1 < end && p + 1 < panels;
                    tile(call, m, m1 - m < tile_rows ? m1 - m : tile_rows, p, ncols, prefetch ? panel_bytes : 0);
                }
            }
    }
}

/* The converted rows of one call (int8 or bfloat16 activations, with their
 * per-block scales or sums): thread-local, grown to the largest call's
 * size, a prefill chunk's included, and never freed (a few KB per row of
 * K; a fresh allocation per call past glibc's mmap threshold would fault
 * its pages in on every call). */
static __thread struct {
    void *data;
    size_t bytes;
} row_scratch;

static void *row_scratch_bytes(size_t bytes)
{
    if (row_scratch.bytes < bytes) {
        free(row_scratch.data);
        row_scratch.data = aligned_alloc(64, (bytes + 63) / 64 * 64);
        row_scratch.bytes = row_scratch.data ? bytes : 0;
    }
    return row_scratch.data;
}
