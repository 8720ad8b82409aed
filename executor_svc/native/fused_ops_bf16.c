/* The elementwise steps of a decoder layer for bfloat16 activations, each one
 * pass over bfloat16 rows: the residual add with RMSNorm, rotary embedding
 * and the SwiGLU gate (fused_ops.c has the float32 ones); and the write of
 * new K/V rows into a bfloat16 or int8 cache, from bfloat16 or float32
 * activations.
 *
 * torch runs each as several kernels, and every bf16 op among them converts
 * its inputs to float32 and its result back (RMSNorm: a float32 copy, square,
 * mean, add, rsqrt, multiply, a bf16 copy, multiply by the weight). Here the
 * values are widened as they are loaded, stay float32 in registers, and are
 * rounded to bfloat16 (nearest even, bf16.h) where torch rounds them:
 *
 *   add + RMSNorm  h = bf16(h + delta)                   stored: the residual stream is bf16
 *                  out = bf16(w * bf16(h * inv_rms))     as transformers' LlamaRMSNorm
 *   rope           bf16(bf16(a * cos) + bf16(b * sin))   as x * cos + rotate_half(x) * sin
 *   SwiGLU gate    bf16(bf16(silu(g)) * u)               as F.silu(gate) * up
 *
 * so every output is torch's bf16 result bit for bit, except where torch's
 * own arithmetic differs in order or precision: the sum of squares (16 lanes,
 * then a tree; torch's mean sums in its own order) and silu's exp (exp512.h,
 * ~2 ulp of float32), which can move a result across a bf16 rounding
 * boundary, i.e. by one bf16 ulp.
 *
 * One row (token) is one thread's work, and nothing a row computes depends
 * on the other rows, so results are the same at every batch size and thread
 * count (--deterministic). Each function returns 0, or -1 where this build
 * has no AVX-512 path (fused_ops.py then never calls it).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "hadamard.h"

/* Rows per thread below which a parallel region costs more than it saves. */
#define MIN_ROWS_PER_THREAD 8

#ifdef __AVX512F__
#include <immintrin.h>

#include "bf16.h"
#include "exp512.h"
#endif

/* x[r] = bf16(x[r] + delta[r]) in place when delta is given; then
 * out[r] = bf16(w * bf16(x[r] / sqrt(mean(x[r]^2) + eps))) over the stored
 * (rounded) x[r]. */
int rms_norm_bf16(uint16_t *out, int64_t ld_out, uint16_t *x, int64_t ld_x, const uint16_t *delta,
                  int64_t ld_delta, const uint16_t *w, int rows, int dim, float eps, int num_threads)
{
#ifdef __AVX512F__
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows >= MIN_ROWS_PER_THREAD * num_threads)
    for (int r = 0; r < rows; r++) {
        uint16_t *xr = x + r * ld_x;
        uint16_t *o = out + r * ld_out;
        __m512 ss = _mm512_setzero_ps(); /* lanes past the row's end load as 0 and add nothing */
        for (int d = 0; d < dim; d += 16) {
            __m512 v = bf16_load_n(xr + d, dim - d);
            if (delta) {
                const __m256i sum = bf16_round(_mm512_add_ps(v, bf16_load_n(delta + r * ld_delta + d, dim - d)));
                bf16_store_bits(xr + d, sum, dim - d);
                v = bf16_widen(sum);
            }
            ss = _mm512_fmadd_ps(v, v, ss);
        }
        const __m512 inv = _mm512_set1_ps(1.f / sqrtf(_mm512_reduce_add_ps(ss) / (float)dim + eps));
        for (int d = 0; d < dim; d += 16) {
            const __m512 normed = bf16_rounded(_mm512_mul_ps(bf16_load_n(xr + d, dim - d), inv));
            bf16_store_n(o + d, _mm512_mul_ps(bf16_load_n(w + d, dim - d), normed), dim - d);
        }
    }
    return 0;
#else
    (void)out; (void)ld_out; (void)x; (void)ld_x; (void)delta; (void)ld_delta; (void)w; (void)rows; (void)dim;
    (void)eps; (void)num_threads;
    return -1;
#endif
}

/* Rotary embedding in place, "rotate half" form, as rope_f32 (fused_ops.c)
 * with torch's bf16 roundings: for d < half, a = v[d], b = v[d + half],
 *
 *     v[d]        <- bf16(bf16(a * cos[t][d])        + bf16(b * sin_signed[t][d]))
 *     v[d + half] <- bf16(bf16(b * cos[t][d + half]) + bf16(a * sin_signed[t][d + half]))
 *
 * x may be a strided view (the q and k heads of a fused qkv row). A token's
 * cos/sin chunk is loaded once for all its heads. */
int rope_bf16(uint16_t *x, int64_t ld_tok, int64_t ld_head, const uint16_t *cos, const uint16_t *sin_signed,
              int64_t ld_cs, int tokens, int heads, int dim, int num_threads)
{
#ifdef __AVX512F__
    const int half = dim / 2;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (tokens >= MIN_ROWS_PER_THREAD * num_threads)
    for (int t = 0; t < tokens; t++) {
        const uint16_t *c = cos + t * ld_cs, *s = sin_signed + t * ld_cs;
        for (int d = 0; d < half; d += 16) {
            const int n = half - d;
            const __m512 c1 = bf16_load_n(c + d, n), c2 = bf16_load_n(c + half + d, n);
            const __m512 s1 = bf16_load_n(s + d, n), s2 = bf16_load_n(s + half + d, n);
            for (int h = 0; h < heads; h++) {
                uint16_t *v = x + t * ld_tok + h * ld_head;
                const __m512 a = bf16_load_n(v + d, n), b = bf16_load_n(v + half + d, n);
                const __m512 ra = _mm512_add_ps(bf16_rounded(_mm512_mul_ps(a, c1)), bf16_rounded(_mm512_mul_ps(b, s1)));
                const __m512 rb = _mm512_add_ps(bf16_rounded(_mm512_mul_ps(b, c2)), bf16_rounded(_mm512_mul_ps(a, s2)));
                bf16_store_n(v + d, ra, n);
                bf16_store_n(v + half + d, rb, n);
            }
        }
    }
    return 0;
#else
    (void)x; (void)ld_tok; (void)ld_head; (void)cos; (void)sin_signed; (void)ld_cs; (void)tokens; (void)heads;
    (void)dim; (void)num_threads;
    return -1;
#endif
}

/* out[r][i] = bf16(bf16(silu(g)) * u), g = gu[r][i], u = gu[r][inter + i]:
 * the SwiGLU gate over a fused [gate | up] projection, silu(g) = g / (1 + e^-g)
 * in float32 as silu_mul_f32 computes it. With `round_silu` 0, silu(g) * u
 * is rounded once instead: silu_mul_f32 over the widened rows, then
 * .to(torch.bfloat16), bit for bit, which a widened bfloat16 model computes
 * between two oneDNN GEMMs (they return bfloat16 and round their input to it). */
static int silu_mul_rows(uint16_t *out, int64_t ld_out, const uint16_t *gu, int64_t ld_gu, int rows, int inter,
                         int round_silu, int num_threads)
{
#ifdef __AVX512F__
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows >= MIN_ROWS_PER_THREAD * num_threads)
    for (int r = 0; r < rows; r++) {
        const uint16_t *g = gu + r * ld_gu, *u = g + inter;
        uint16_t *o = out + r * ld_out;
        for (int i = 0; i < inter; i += 16) {
            const __m512 gv = bf16_load_n(g + i, inter - i);
            const __m512 silu = silu512(gv);
            bf16_store_n(o + i, _mm512_mul_ps(round_silu ? bf16_rounded(silu) : silu, bf16_load_n(u + i, inter - i)),
                         inter - i);
        }
    }
    return 0;
#else
    (void)out; (void)ld_out; (void)gu; (void)ld_gu; (void)rows; (void)inter; (void)round_silu; (void)num_threads;
    return -1;
#endif
}

int silu_mul_bf16(uint16_t *out, int64_t ld_out, const uint16_t *gu, int64_t ld_gu, int rows, int inter,
                  int num_threads)
{
    return silu_mul_rows(out, ld_out, gu, ld_gu, rows, inter, 1, num_threads);
}

int silu_mul_f32_bf16_io(uint16_t *out, int64_t ld_out, const uint16_t *gu, int64_t ld_gu, int rows, int inter,
                         int num_threads)
{
    return silu_mul_rows(out, ld_out, gu, ld_gu, rows, inter, 0, num_threads);
}

/* One row of n values into the bf16 cache: copied from bf16, or rounded
 * from float32 as torch's .to(torch.bfloat16) rounds (AVX-512 builds only;
 * kv_write_bf16 refuses float32 sources elsewhere). */
static void row_to_bf16(uint16_t *dst, const void *src, int n, int src_f32)
{
    if (!src_f32) {
        memcpy(dst, src, (size_t)n * sizeof(uint16_t));
        return;
    }
#ifdef __AVX512F__
    const float *f = src;
    for (int i = 0; i < n; i += 16) {
        const int left = n - i;
        const __mmask16 m = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
        bf16_store_n(dst + i, _mm512_maskz_loadu_ps(m, f + i), left);
    }
#endif
}

/* The K and V rows of the token WRITE_AHEAD on (`bytes` each), asked for
 * before they are written: a decode's slot is a cold line, and each row's
 * store otherwise waited for its read for ownership (the int8 write of 64
 * decodes over 30 layers: 1.43-1.62x faster with these). */
#define WRITE_AHEAD 4

static inline void prefetch_for_write(const void *k_row, const void *v_row, int64_t bytes)
{
    for (int64_t b = 0; b < bytes + 63; b += 64) {
        __builtin_prefetch((const char *)k_row + (b < bytes ? b : bytes - 1), 1, 3);
        __builtin_prefetch((const char *)v_row + (b < bytes ? b : bytes - 1), 1, 3);
    }
}

/* The KV-cache write: k_cache[slots[t]] = k[t] and v_cache[slots[t]] = v[t],
 * each a row of heads x dim values (contiguous in the cache; k and v may be
 * strided views, the k and v heads of a fused qkv row; strides in elements).
 * k and v are bfloat16 (plain copies) or, with src_f32, float32 rounded to
 * bfloat16 on the way: a widened bf16 model's float32 activations into its
 * bf16 cache, where torch converts in one more operator call each. One
 * thread: a step's new K/V rows are a few hundred KB at most, where torch's
 * index_copy_ costs two operator calls a layer. Returns -2, writing nothing,
 * if a slot lies outside [0, num_slots); -1 for a float32 source in a build
 * without AVX-512. */
int kv_write_bf16(uint16_t *k_cache, uint16_t *v_cache, int64_t num_slots, const void *k, int64_t ld_k_tok,
                  int64_t ld_k_head, const void *v, int64_t ld_v_tok, int64_t ld_v_head, int src_f32,
                  const int64_t *slots, int tokens, int heads, int dim)
{
#ifndef __AVX512F__
    if (src_f32)
        return -1;
#endif
    for (int t = 0; t < tokens; t++)
        if (slots[t] < 0 || slots[t] >= num_slots)
            return -2;
    const int64_t size = src_f32 ? (int64_t)sizeof(float) : (int64_t)sizeof(uint16_t);
    const int64_t token_bytes = (int64_t)heads * dim * (int64_t)sizeof(uint16_t);
    const char *kb = k, *vb = v;
    for (int t = 0; t < tokens && t < WRITE_AHEAD; t++)
        prefetch_for_write(k_cache + slots[t] * heads * dim, v_cache + slots[t] * heads * dim, token_bytes);
    for (int t = 0; t < tokens; t++) {
        uint16_t *kc = k_cache + slots[t] * heads * dim, *vc = v_cache + slots[t] * heads * dim;
        if (t + WRITE_AHEAD < tokens)
            prefetch_for_write(k_cache + slots[t + WRITE_AHEAD] * heads * dim,
                               v_cache + slots[t + WRITE_AHEAD] * heads * dim, token_bytes);
        for (int h = 0; h < heads; h++) {
            row_to_bf16(kc + h * dim, kb + (t * ld_k_tok + h * ld_k_head) * size, dim, src_f32);
            row_to_bf16(vc + h * dim, vb + (t * ld_v_tok + h * ld_v_head) * size, dim, src_f32);
        }
    }
    return 0;
}

static inline float widen_bf16_scalar(uint16_t h)
{
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* One row of n values (bfloat16, or float32 with src_f32) quantized into an
 * int8 cache row: n int8 values and their float32 scale after them,
 * value = int8 x scale, scale = max|x| / 127, int8 = round-half-even(x x
 * 127 / max|x|), over x = the row, or its normalized Walsh-Hadamard
 * transform with `rotate` (keys, n a power of two: hadamard.h): the formula
 * executor_svc/kv_quant.py's quantize_rows computes in torch, op for op, so
 * both write the same bytes. A row with a NaN gets a NaN scale (attention
 * over it is NaN, as it would be over the values themselves); a row of
 * zeros, scale 0. */
static void row_to_int8(int8_t *dst, const void *src, int n, int src_f32, int rotate)
{
    float x[n];
    for (int i = 0; i < n; i++) x[i] = src_f32 ? ((const float *)src)[i] : widen_bf16_scalar(((const uint16_t *)src)[i]);
    if (rotate)
        fwht_normalized(x, n);
    float amax = 0.f;
    for (int i = 0; i < n; i++) {
        const float a = fabsf(x[i]);
        amax = a != a || amax != amax ? NAN : a > amax ? a : amax;
    }
    const float scale = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
    for (int i = 0; i < n; i++) {
        const float r = nearbyintf(x[i] * inv);
        dst[i] = (int8_t)(r != r ? 0.f : r > 127.f ? 127.f : r < -127.f ? -127.f : r);
    }
    memcpy(dst + n, &scale, sizeof scale);
}

#ifdef __AVX512F__
/* row_to_int8 for n a multiple of 16 up to 256 (rotated: a power of two), in
 * registers: the same operations on the same values, so the same bytes
 * (tests/test_kv_int8.py compares both with kv_quant.py). */
static void row_to_int8_avx512(int8_t *dst, const void *src, int n, int src_f32, int rotate)
{
    __m512 x[16];
    const int nv = n / 16;
    for (int v = 0; v < nv; v++)
        x[v] = src_f32 ? _mm512_loadu_ps((const float *)src + 16 * v)
                       : bf16_widen(_mm256_loadu_si256((const __m256i *)((const uint16_t *)src + 16 * v)));
    if (rotate)
        fwht_normalized_x16(x, nv);
    __m512 amax_v = _mm512_setzero_ps();
    __mmask16 nan = 0;
    for (int v = 0; v < nv; v++) {
        nan |= _mm512_cmp_ps_mask(x[v], x[v], _CMP_UNORD_Q);
        amax_v = _mm512_max_ps(amax_v, _mm512_abs_ps(x[v]));
    }
    const float amax = nan ? NAN : _mm512_reduce_max_ps(amax_v);
    const float scale = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
    const __m512 vinv = _mm512_set1_ps(inv), hi = _mm512_set1_ps(127.f), lo = _mm512_set1_ps(-127.f);
    for (int v = 0; v < nv; v++) {
        const __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(x[v], vinv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __mmask16 ok = _mm512_cmp_ps_mask(r, r, _CMP_ORD_Q);
        const __m512i q = _mm512_cvtps_epi32(_mm512_maskz_mov_ps(ok, _mm512_min_ps(_mm512_max_ps(r, lo), hi)));
        _mm_storeu_si128((__m128i *)(dst + 16 * v), _mm512_cvtepi32_epi8(q));
    }
    memcpy(dst + n, &scale, sizeof scale);
}
#endif

/* kv_write_bf16's write into an int8 cache (--kv-cache-dtype int8): rows of
 * heads x (dim + 4) bytes, each head's row quantized by row_to_int8, the
 * keys rotated where dim is a power of two. Returns -2, writing nothing, if
 * a slot lies outside [0, num_slots). */
int kv_write_int8(int8_t *k_cache, int8_t *v_cache, int64_t num_slots, const void *k, int64_t ld_k_tok,
                  int64_t ld_k_head, const void *v, int64_t ld_v_tok, int64_t ld_v_head, int src_f32,
                  const int64_t *slots, int tokens, int heads, int dim)
{
    for (int t = 0; t < tokens; t++)
        if (slots[t] < 0 || slots[t] >= num_slots)
            return -2;
    const int64_t size = src_f32 ? (int64_t)sizeof(float) : (int64_t)sizeof(uint16_t), row = dim + 4;
    const int rotate = is_power_of_two(dim);
    void (*quantize)(int8_t *, const void *, int, int, int) = row_to_int8;
#ifdef __AVX512F__
    if (dim % 16 == 0 && dim <= 256)
        quantize = row_to_int8_avx512;
#endif
    const char *kb = k, *vb = v;
    const int64_t token_bytes = heads * row;
    for (int t = 0; t < tokens && t < WRITE_AHEAD; t++)
        prefetch_for_write(k_cache + slots[t] * token_bytes, v_cache + slots[t] * token_bytes, token_bytes);
    for (int t = 0; t < tokens; t++) {
        int8_t *kc = k_cache + slots[t] * token_bytes, *vc = v_cache + slots[t] * token_bytes;
        if (t + WRITE_AHEAD < tokens)
            prefetch_for_write(k_cache + slots[t + WRITE_AHEAD] * token_bytes,
                               v_cache + slots[t + WRITE_AHEAD] * token_bytes, token_bytes);
        for (int h = 0; h < heads; h++) {
            quantize(kc + h * row, kb + (t * ld_k_tok + h * ld_k_head) * size, dim, src_f32, rotate);
            quantize(vc + h * row, vb + (t * ld_v_tok + h * ld_v_head) * size, dim, src_f32, 0);
        }
    }
    return 0;
}
