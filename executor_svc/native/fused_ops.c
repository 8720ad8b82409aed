/* The elementwise steps of a decoder layer, each fused into one pass, for
 * float32 on CPU: RMSNorm (with the residual add before it), rotary embedding
 * and the SwiGLU gate; and the greedy sampler's row argmax.
 *
 * In PyTorch, RMSNorm is five kernels (square, mean, add eps, rsqrt, two
 * multiplies), rotary embedding four (a concatenation for the rotated half,
 * two multiplies, an add) and the gate two (silu, multiply), each reading
 * and writing a whole [tokens, width] tensor. Here each is one pass over
 * its rows, rows split across threads: 14x (RMSNorm) and 42x (rope)
 * faster than torch at 2,048 rows. The sampler's two row scans live here
 * too: the greedy rows' argmax and the random rows' exponential race.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Rows per thread below which a parallel region costs more than it saves. */
#define MIN_ROWS_PER_THREAD 8

/* The residual add (x += delta, in place, where delta is given) and then
 * 1 / sqrt(mean(x^2) + eps) of one row: shared by rms_norm_f32 and its
 * bf16-out form, so that both compute the same sums. */
static inline float add_inv_rms(float *xr, const float *dr, int dim, float eps)
{
    if (dr) {
#pragma omp simd
        for (int d = 0; d < dim; d++)
            xr[d] += dr[d];
    }
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int d = 0; d < dim; d++)
        ss += xr[d] * xr[d];
    return 1.f / sqrtf(ss / (float)dim + eps);
}

/* out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w, for rows of `dim` floats.
 * With `delta`, the residual add comes first, in place: x[r] += delta[r],
 * then x[r] is normalised. For hidden sizes up to a few thousand the row is
 * still in L1 for the norm's loops, so the add costs no extra pass over
 * memory (torch: one more kernel). */
void rms_norm_f32(float *out, int64_t ld_out, float *x, int64_t ld_x, const float *delta, int64_t ld_delta,
                  const float *w, int rows, int dim, float eps, int num_threads)
{
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows >= MIN_ROWS_PER_THREAD * num_threads)
    for (int r = 0; r < rows; r++) {
        float *xr = x + r * ld_x;
        float *o = out + r * ld_out;
        const float inv = add_inv_rms(xr, delta ? delta + r * ld_delta : NULL, dim, eps);
#pragma omp simd
        for (int d = 0; d < dim; d++)
            o[d] = xr[d] * inv * w[d];
    }
}

/* Rotary embedding in place, "rotate half" form, per token t and head h:
 *
 *     v = x[t][h]:  v[d]        <- v[d] * cos[t][d]               + v[d + half] * sin_signed[t][d]
 *                   v[d + half] <- v[d + half] * cos[t][d + half] + v[d] * sin_signed[t][d + half]
 *
 * (d < half; sin_signed is -sin on the first half, +sin on the second).
 * x may be a strided view (the q and k heads of a fused qkv row). */
void rope_f32(float *x, int64_t ld_tok, int64_t ld_head, const float *cos, const float *sin_signed, int64_t ld_cs,
              int tokens, int heads, int dim, int num_threads)
{
    const int half = dim / 2;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (tokens >= MIN_ROWS_PER_THREAD * num_threads)
    for (int t = 0; t < tokens; t++) {
        const float *c = cos + t * ld_cs, *s = sin_signed + t * ld_cs;
        for (int h = 0; h < heads; h++) {
            float *v = x + t * ld_tok + h * ld_head;
#pragma omp simd
            for (int d = 0; d < half; d++) {
                const float a = v[d], b = v[d + half];
                v[d] = a * c[d] + b * s[d];
                v[d + half] = b * c[d + half] + a * s[d + half];
            }
        }
    }
}

/* out[r][i] = silu(g) * u = g / (1 + e^-g) * u, with g = gu[r][i] and
 * u = gu[r][inter + i]: the SwiGLU gate over a fused [gate | up] projection.
 *
 * Written with intrinsics and an inline vector exp: an earlier version left
 * the loop to the compiler with a scalar exp and ran ~10x slower than
 * torch's silu and multiply (docs/benchmarks.md). Returns -1 where this
 * build has no AVX-512 path, and the caller keeps torch's. */
#ifdef __AVX512F__
#include <immintrin.h>

#include "bf16.h"
#include "exp512.h"
#include "log512.h"
#endif

/* rms_norm_f32 with each output rounded to bfloat16 as torch rounds
 * (bf16.h; a NaN becomes 0x7FC0) as it is stored: the input of a GEMM that
 * reads bf16 rows (the dot route), without the float32 row written and read
 * back by a separate rounding pass. The same float32 values first, bit for
 * bit. Returns 0; -1 where this build has no AVX-512 path. */
int rms_norm_f32_bf16_out(uint16_t *out, int64_t ld_out, float *x, int64_t ld_x, const float *delta,
                          int64_t ld_delta, const float *w, int rows, int dim, float eps, int num_threads)
{
#ifdef __AVX512F__
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows >= MIN_ROWS_PER_THREAD * num_threads)
    for (int r = 0; r < rows; r++) {
        float *xr = x + r * ld_x;
        const __m512 inv = _mm512_set1_ps(add_inv_rms(xr, delta ? delta + r * ld_delta : NULL, dim, eps));
        for (int d = 0; d < dim; d += 16) {
            const int n = dim - d < 16 ? dim - d : 16;
            const __mmask16 m = n == 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1);
            const __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, xr + d), inv),
                                           _mm512_maskz_loadu_ps(m, w + d));
            bf16_store_n(out + r * ld_out + d, v, n);
        }
    }
    return 0;
#else
    (void)out; (void)ld_out; (void)x; (void)ld_x; (void)delta; (void)ld_delta; (void)w; (void)rows; (void)dim;
    (void)eps; (void)num_threads;
    return -1;
#endif
}

int silu_mul_f32(float *out, int64_t ld_out, const float *gu, int64_t ld_gu, int rows, int inter, int num_threads)
{
#ifdef __AVX512F__
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows >= MIN_ROWS_PER_THREAD * num_threads)
    for (int r = 0; r < rows; r++) {
        const float *g = gu + r * ld_gu, *u = g + inter;
        float *o = out + r * ld_out;
        for (int i = 0; i < inter; i += 16) {
            const __mmask16 m = inter - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (inter - i)) - 1);
            const __m512 gv = _mm512_maskz_loadu_ps(m, g + i), uv = _mm512_maskz_loadu_ps(m, u + i);
            _mm512_mask_storeu_ps(o + i, m, _mm512_mul_ps(silu512(gv), uv));
        }
    }
    return 0;
#else
    (void)out; (void)ld_out; (void)gu; (void)ld_gu; (void)rows; (void)inter; (void)num_threads;
    return -1;
#endif
}

#ifdef __AVX512F__
/* The lanes of the 16 columns from i that lie inside a row of `cols`. */
static inline __mmask16 tail_mask(int cols, int i)
{
    return cols - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (cols - i)) - 1);
}

/* lowbias32 on 16 lanes: seeded_noise.py's _mix32_, in 32-bit lanes. */
static inline __m512i mix32(__m512i x)
{
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7FEB352D));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32((int)0x846CA68Bu));
    return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

/* The first index of a row's largest score, or of its first NaN; 0 for a
 * row of only -inf. The score is x, or with `noisy` x - ln(-ln u) for the
 * uniforms hashed from `key` (race_rows_f32). Each lane keeps its own
 * running maximum and where it first saw it (a strict > keeps the
 * earliest); the lanes then agree on the largest value and the smallest
 * index holding it. Inlined into each caller with `noisy` constant. */
static inline __attribute__((always_inline)) int64_t scan_row(const float *xr, int cols, int noisy, __m512i key)
{
    __m512 best = _mm512_set1_ps(-INFINITY);
    __m512i best_i = _mm512_setzero_si512();
    __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i step = _mm512_set1_epi32(16), salt = _mm512_set1_epi32((int)0xC2B2AE35u);
    int first_nan = -1;
    for (int i = 0; i < cols; i += 16, idx = _mm512_add_epi32(idx, step)) {
        const __mmask16 m = tail_mask(cols, i);
        __m512 s = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), m, xr + i);
        if (noisy) {
            const __m512i h = mix32(_mm512_xor_si512(key, mix32(mix32(_mm512_xor_si512(idx, salt)))));
            const __m512 u = _mm512_mul_ps(_mm512_add_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(h, 9)),
                                                         _mm512_set1_ps(0.5f)),
                                           _mm512_set1_ps(1.0f / (1 << 23)));
            const __m512 e = _mm512_sub_ps(_mm512_setzero_ps(), log512(u)); /* in [6e-8, 16.6] */
            s = _mm512_sub_ps(s, log512(e));
        }
        const __mmask16 nan = _mm512_cmp_ps_mask(s, s, _CMP_UNORD_Q);
        if (nan) /* chunks are scanned in order: this is the row's first NaN */
            return i + __builtin_ctz(nan);
        const __mmask16 gt = _mm512_cmp_ps_mask(s, best, _CMP_GT_OQ);
        best = _mm512_mask_mov_ps(best, gt, s);
        best_i = _mm512_mask_mov_epi32(best_i, gt, idx);
    }
    const float top = _mm512_reduce_max_ps(best);
    const __mmask16 at_top = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
    /* A row of only -inf: no lane ever beat its start, and index 0 is the first maximum. */
    return top == -INFINITY ? 0 : _mm512_mask_reduce_min_epi32(at_top, best_i);
}
#endif

/* out[r] = the index of the largest x[r][i] (the first one on ties), or of
 * the first NaN in the row if it has any: torch.argmax's answer, for the
 * greedy rows of a step's logits. torch's argmax over the last dimension ran
 * ~9x slower than its max (2.4 ms for 64 x 49,152). Returns -1 where this
 * build has no AVX-512 path, and the caller keeps torch's. */
int argmax_rows_f32(int64_t *out, const float *x, int64_t ld_x, int rows, int cols, int num_threads)
{
#ifdef __AVX512F__
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows >= 2)
    for (int r = 0; r < rows; r++)
        out[r] = scan_row(x + r * ld_x, cols, 0, _mm512_setzero_si512());
    return 0;
#else
    (void)out; (void)x; (void)ld_x; (void)rows; (void)cols; (void)num_threads;
    return -1;
#endif
}

/* out[r] = argmax_v x[r][v] - ln E_v with E_v = -ln u_v: the sampler's
 * exponential race (sampler.py) for rows of tempered, masked logits, one
 * pass instead of torch's rand, two logs, a subtraction and an argmax (22 ms
 * for 64 x 49,152 on an AMD EPYC, 2 threads). u_v is seeded_noise.py's
 * uniform for row key keys[r] (its 32-bit key after the seed and position
 * rounds) and token v: (mix32(key ^ mix32(mix32(v ^ 0xC2B2AE35))) >> 9 + 0.5)
 * / 2^23, bit for bit; ln is log512.h's (torch's differs in the last bits).
 * Ties go to the first index, a NaN score to the first NaN (as argmax_rows);
 * a row of only -inf gives 0. Returns -1 where this build has no AVX-512 path. */
int race_rows_f32(int64_t *out, const float *x, int64_t ld_x, const int64_t *keys, int rows, int cols,
                  int num_threads)
{
#ifdef __AVX512F__
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows >= 2)
    for (int r = 0; r < rows; r++)
        out[r] = scan_row(x + r * ld_x, cols, 1, _mm512_set1_epi32((int)(uint32_t)keys[r]));
    return 0;
#else
    (void)out; (void)x; (void)ld_x; (void)keys; (void)rows; (void)cols; (void)num_threads;
    return -1;
#endif
}

/* out[r][j] = seeded_noise.seeded_uniform's u for row key keys[r] and token
 * key vkeys[j] (ld_vk 0: one row of keys for every row) or vkeys[r * ld_vk + j]:
 * (mix32(key ^ vkey) >> 9 + 0.5) / 2^23, bit for bit (every step is exact in
 * 32-bit integers, and x + 0.5 for x < 2^23 and the power-of-two scale are
 * exact in float32). torch's int64 ops made twelve passes over a 64 x 49,152
 * row block for it. Keys are in [0, 2^32). Returns -1 where this build has no
 * AVX-512 path. */
int seeded_uniform_rows_f32(float *out, int64_t ld_out, const int64_t *keys, const int64_t *vkeys, int64_t ld_vk,
                            int rows, int cols, int num_threads)
{
#ifdef __AVX512F__
    const __m512i lo32 = _mm512_set1_epi64(0xFFFFFFFF);
#pragma omp parallel for num_threads(num_threads) schedule(static) if ((int64_t)rows * cols >= 65536)
    for (int r = 0; r < rows; r++) {
        const __m512i key = _mm512_set1_epi32((int)(uint32_t)keys[r]);
        const int64_t *vk = vkeys + (int64_t)r * ld_vk;
        for (int i = 0; i < cols; i += 16) {
            const __mmask16 m = tail_mask(cols, i);
            /* The 16 token keys' low 32 bits (all of them: they are < 2^32), two 8-lane halves. */
            const __m512i a = _mm512_and_si512(_mm512_maskz_loadu_epi64((__mmask8)m, vk + i), lo32);
            const __m512i b = _mm512_and_si512(_mm512_maskz_loadu_epi64((__mmask8)(m >> 8), vk + i + 8), lo32);
            const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi64_epi32(a)),
                                                 _mm512_cvtepi64_epi32(b), 1);
            const __m512i h = _mm512_srli_epi32(mix32(_mm512_xor_si512(key, v)), 9);
            const __m512 u = _mm512_mul_ps(_mm512_add_ps(_mm512_cvtepi32_ps(h), _mm512_set1_ps(0.5f)),
                                           _mm512_set1_ps(1.0f / 8388608.0f));
            _mm512_mask_storeu_ps(out + (int64_t)r * ld_out + i, m, u);
        }
    }
    return 0;
#else
    (void)out; (void)ld_out; (void)keys; (void)vkeys; (void)ld_vk; (void)rows; (void)cols; (void)num_threads;
    return -1;
#endif
}

#ifdef __AVX512F__
/* The row's largest value (-inf for an all -inf row); *nan says whether it holds a NaN. */
static float row_max(const float *xr, int cols, int *nan)
{
    __m512 top16 = _mm512_set1_ps(-INFINITY);
    __mmask16 unordered = 0;
    for (int i = 0; i < cols; i += 16) {
        const __mmask16 m = tail_mask(cols, i);
        const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), m, xr + i);
        unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        top16 = _mm512_max_ps(top16, v);
    }
    *nan = unordered != 0;
    return _mm512_reduce_max_ps(top16);
}
#endif

/* out[r] = ln sum_v e^x[r][v], each row's logsumexp for the sampler's top-p
 * (top_p.py): its max, then the sum of e^(x - max) in 16 lanes and across
 * them, two passes over the row where torch's logsumexp made five (max,
 * subtract, exp, sum, log) and took 3.2 ms for 64 x 49,152 on an AMD EPYC.
 * exp512's ~2 ulp and this order of summation put it within a few float32
 * roundings of torch's value. As torch: a row with a NaN gives NaN, a row
 * whose largest value is infinite gives that infinity (an all -inf row,
 * -inf). Each row is one thread's, summed in one order, so its value does
 * not depend on the rows beside it. Returns -1 where this build has no
 * AVX-512 path, and the caller keeps torch's. */
int logsumexp_rows_f32(float *out, const float *x, int64_t ld_x, int rows, int cols, int num_threads)
{
#ifdef __AVX512F__
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows >= 2)
    for (int r = 0; r < rows; r++) {
        const float *xr = x + r * ld_x;
        int nan;
        const float top = row_max(xr, cols, &nan);
        if (nan || isinf(top)) {
            out[r] = nan ? NAN : top;
            continue;
        }
        /* Lanes past the row's end add nothing; a -inf inside it adds exp512's
         * floor, e^-87 ~ 1.6e-38, against the max's own 1. */
        const __m512 t = _mm512_set1_ps(top);
        __m512 sum[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int i = 0; i < cols; i += 16) {
            const __mmask16 m = tail_mask(cols, i);
            const __m512 v = _mm512_maskz_loadu_ps(m, xr + i);
            sum[(i >> 4) & 1] = _mm512_add_ps(sum[(i >> 4) & 1], _mm512_maskz_mov_ps(m, exp512(_mm512_sub_ps(v, t))));
        }
        out[r] = top + logf(_mm512_reduce_add_ps(_mm512_add_ps(sum[0], sum[1])));
    }
    return 0;
#else
    (void)out; (void)x; (void)ld_x; (void)rows; (void)cols; (void)num_threads;
    return -1;
#endif
}

#ifdef __AVX512F__
/* How many of the row's values are >= t. */
static int count_at_least(const float *xr, int cols, float t)
{
    const __m512 tv = _mm512_set1_ps(t);
    int n = 0;
    for (int i = 0; i < cols; i += 16) {
        const __mmask16 m = tail_mask(cols, i);
        n += __builtin_popcount(_mm512_mask_cmp_ps_mask(m, _mm512_maskz_loadu_ps(m, xr + i), tv, _CMP_GE_OQ));
    }
    return n;
}

/* A threshold t with at least k of the row's values >= t and, where ties
 * allow, at most 4k (*count: how many): from the row's max m, t = m - d for
 * d doubling until k values reach it, then bisected towards the fewest. t
 * reaches -inf (every value) at the latest, so k <= cols always ends it. */
static float top_threshold(const float *xr, int cols, int k, float m, int *count)
{
    float d = 1.f, t = m - d;
    int n = count_at_least(xr, cols, t);
    while (n < k) {
        d *= 2.f;
        t = m - d;
        n = count_at_least(xr, cols, t);
    }
    float lo = t, hi = m - d / 2; /* count(lo) >= k; count(hi) < k unless d was the first */
    for (int it = 0; it < 24 && n > 4 * k && hi > lo; it++) {
        const float mid = lo + (hi - lo) / 2;
        if (mid <= lo || mid >= hi)
            break;
        const int c = count_at_least(xr, cols, mid);
        if (c >= k) {
            lo = mid;
            n = c;
        } else {
            hi = mid;
        }
    }
    *count = n;
    return lo;
}

/* The float whose order key (a negative float's bits inverted, a positive
 * one's sign bit set: larger floats, larger unsigned keys) is `key`. */
static inline float key_value(uint32_t key)
{
    const uint32_t u = key & 0x80000000u ? key & 0x7FFFFFFFu : ~key;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Sorts n (key, id) pairs by key, descending, stably (equal keys keep their
 * order): LSD radix sort on the inverted key, a byte at a time, skipping the
 * bytes every key shares. Each pass moves the pairs between the arrays and
 * the scratch (*key2, *id2), so the pointers end on whichever holds them. */
static void sort_desc(uint32_t **key, int32_t **id, uint32_t **key2, int32_t **id2, int n)
{
    uint32_t *k = *key, *k2 = *key2;
    int32_t *d = *id, *d2 = *id2;
    for (int i = 0; i < n; i++)
        k[i] = ~k[i];
    for (int shift = 0; shift < 32; shift += 8) {
        int count[257] = {0};
        for (int i = 0; i < n; i++)
            count[((k[i] >> shift) & 0xFF) + 1]++;
        if (count[((k[0] >> shift) & 0xFF) + 1] == n)
            continue;
        for (int b = 0; b < 256; b++)
            count[b + 1] += count[b];
        for (int i = 0; i < n; i++) {
            const int at = count[(k[i] >> shift) & 0xFF]++;
            k2[at] = k[i];
            d2[at] = d[i];
        }
        uint32_t *tk = k;
        k = k2;
        k2 = tk;
        int32_t *td = d;
        d = d2;
        d2 = td;
    }
    for (int i = 0; i < n; i++)
        k[i] = ~k[i];
    *key = k, *key2 = k2, *id = d, *id2 = d2;
}

/* Each row's k largest values in descending order, with their indices:
 * values [rows, ld_v], ids [rows, ld_i] (int64). Equal values come in index
 * order (-0 as +0, which it returns); the values are torch.topk's exactly
 * (its order among equal values is its own). Per row: a max pass, a few counting passes for a threshold t
 * that at least k and (ties allowing) at most 4k values reach, one pass
 * gathering those, and a radix sort of them, where torch's topk took 5.8 ms
 * for k = 256 of 64 x 49,152 on an AMD EPYC (2 threads). Each row is one
 * thread's, so its answer does not depend on the rows beside it. Returns 0;
 * -1 where this build has no AVX-512 path; -2 if a row holds a NaN or +inf
 * (torch orders those; the caller keeps torch's topk); -3 if
 * a row's scratch could not be allocated; -4 for k outside 1..cols. */
int topk_rows_f32(float *values, int64_t ld_v, int64_t *ids, int64_t ld_i, const float *x, int64_t ld_x, int rows,
                  int cols, int k, int num_threads)
{
    if (k < 1 || k > cols)
        return -4;
    int status = 0;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic) if (rows >= 2)
    for (int r = 0; r < rows; r++) {
        const float *xr = x + r * ld_x;
        int nan;
        const float m = row_max(xr, cols, &nan);
        if (nan || m == INFINITY) { /* (an all -inf row is fine: its threshold is -inf at once) */
#pragma omp atomic write
            status = -2;
            continue;
        }
        /* The whole row (top-p's last tier) needs no threshold: where it holds -inf
         * (top-k's mask), the search below would double its distance to -inf ~128 times. */
        int n = cols;
        const float t = k == cols ? -INFINITY : top_threshold(xr, cols, k, m, &n);
        const size_t room = (size_t)n + 16; /* a gather stores whole vectors */
        uint32_t *buf = malloc(room * 4 * sizeof(uint32_t));
        if (!buf) {
#pragma omp atomic write
            status = -3;
            continue;
        }
        uint32_t *key = buf, *key2 = buf + 2 * room;
        int32_t *id = (int32_t *)(buf + room), *id2 = (int32_t *)(buf + 3 * room);
        const __m512 tv = _mm512_set1_ps(t);
        const __m512i sign = _mm512_set1_epi32((int)0x80000000u), step = _mm512_set1_epi32(16);
        __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        int got = 0;
        for (int i = 0; i < cols; i += 16, idx = _mm512_add_epi32(idx, step)) {
            const __mmask16 lanes = tail_mask(cols, i);
            const __m512 v = _mm512_maskz_loadu_ps(lanes, xr + i);
            const __mmask16 ge = _mm512_mask_cmp_ps_mask(lanes, v, tv, _CMP_GE_OQ);
            if (!ge)
                continue;
            /* Each value's order key (key_value's inverse), 16 lanes at once;
             * -0 as +0, so that they tie as the comparisons have them. */
            __m512i u = _mm512_castps_si512(v);
            u = _mm512_mask_mov_epi32(u, _mm512_cmpeq_epi32_mask(u, sign), _mm512_setzero_si512());
            const __m512i kv = _mm512_xor_si512(u, _mm512_or_si512(_mm512_srai_epi32(u, 31), sign));
            _mm512_storeu_si512((void *)(key + got), _mm512_maskz_compress_epi32(ge, kv));
            _mm512_storeu_si512((void *)(id + got), _mm512_maskz_compress_epi32(ge, idx));
            got += __builtin_popcount(ge);
        }
        sort_desc(&key, &id, &key2, &id2, got);
        for (int j = 0; j < k; j++) {
            values[r * ld_v + j] = key_value(key[j]);
            ids[r * ld_i + j] = id[j];
        }
        free(buf);
    }
    return status;
}
#else
int topk_rows_f32(float *values, int64_t ld_v, int64_t *ids, int64_t ld_i, const float *x, int64_t ld_x, int rows,
                  int cols, int k, int num_threads)
{
    (void)values; (void)ld_v; (void)ids; (void)ld_i; (void)x; (void)ld_x; (void)rows; (void)cols; (void)k;
    (void)num_threads;
    return -1;
}
#endif

/* out[r][v] = min(x[r][v] / t[r], FLT_MAX): the sampler's temperature in one
 * pass where torch made two over a fresh tensor (the division, then the
 * clamp that keeps a saturated penalty over a temperature below 1 finite).
 * The quotient is IEEE division's, as torch's, so the bits are its; NaN
 * stays NaN and -inf -inf. Returns -1 where this build has no AVX-512 path. */
int temper_rows_f32(float *out, int64_t ld_out, const float *x, int64_t ld_x, const float *t, int rows, int cols,
                    int num_threads)
{
#ifdef __AVX512F__
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows >= 2)
    for (int r = 0; r < rows; r++) {
        const __m512 tv = _mm512_set1_ps(t[r]), most = _mm512_set1_ps(3.40282347e+38f);
        for (int i = 0; i < cols; i += 16) {
            const __mmask16 m = tail_mask(cols, i);
            /* min(most, q) returns q where q is NaN (the second operand on unordered). */
            const __m512 q = _mm512_div_ps(_mm512_maskz_loadu_ps(m, x + r * ld_x + i), tv);
            _mm512_mask_storeu_ps(out + r * ld_out + i, m, _mm512_min_ps(most, q));
        }
    }
    return 0;
#else
    (void)out; (void)ld_out; (void)x; (void)ld_x; (void)t; (void)rows; (void)cols; (void)num_threads;
    return -1;
#endif
}
