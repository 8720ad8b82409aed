/* The normalized Walsh-Hadamard transform of an int8 KV cache's keys
 * (--kv-cache-dtype int8, executor_svc/kv_quant.py): y = H x / sqrt(n) for
 * n a power of two, H the Sylvester Hadamard matrix. H / sqrt(n) is
 * orthonormal and its own inverse, so q.k = (Hq).(Hk) / n: the keys are
 * stored rotated and each query is rotated once where it meets them.
 *
 * Why: a model's keys have a few channels far larger than the rest, and one
 * int8 scale per row spends its 255 levels on those; the rotation spreads
 * every channel over all of them. On the embedded SmolLM2 it cut the int8
 * cache's top-5 logprob error by ~40% (docs/optimization_log.md).
 *
 * The butterflies run in this order and the scale multiplies last, as
 * kv_quant.fwht does in torch, so both give the same float32 bits. */
#ifndef PAGEDSERVE_HADAMARD_H
#define PAGEDSERVE_HADAMARD_H
#include <math.h>

static inline int is_power_of_two(int n) { return n > 0 && (n & (n - 1)) == 0; }

static inline void fwht_normalized(float *x, int n)
{
    for (int h = 1; h < n; h *= 2)
        for (int i = 0; i < n; i += 2 * h)
            for (int j = i; j < i + h; j++) {
                const float a = x[j], b = x[j + h];
                x[j] = a + b;
                x[j + h] = a - b;
            }
    const float s = 1.f / sqrtf((float)n);
    for (int i = 0; i < n; i++) x[i] *= s;
}

#ifdef __AVX512F__
#include <immintrin.h>

/* fwht_normalized over n = 16 * nv values held in x[0 .. nv - 1], nv a power
 * of two: the same operations on the same values, so the same bits. The
 * butterflies within a vector pair lane j with lane j ^ h: the lower lane's
 * a + b is the swapped value plus its own, the upper lane's a - b the
 * swapped value minus its own (an FMA by -1: the product is exact, so one
 * rounding, as the subtraction). */
static inline __attribute__((always_inline)) void fwht_normalized_x16(__m512 *x, int nv)
{
    for (int h = 1; h < 16; h *= 2) {
        float sign[16];
        int swap[16];
        for (int j = 0; j < 16; j++) {
            sign[j] = (j & h) ? -1.f : 1.f;
            swap[j] = j ^ h;
        }
        const __m512 s = _mm512_loadu_ps(sign);
        const __m512i p = _mm512_loadu_si512((const void *)swap);
        for (int v = 0; v < nv; v++) x[v] = _mm512_fmadd_ps(x[v], s, _mm512_permutexvar_ps(p, x[v]));
    }
    for (int h = 1; h < nv; h *= 2)
        for (int i = 0; i < nv; i += 2 * h)
            for (int j = i; j < i + h; j++) {
                const __m512 a = x[j], b = x[j + h];
                x[j] = _mm512_add_ps(a, b);
                x[j + h] = _mm512_sub_ps(a, b);
            }
    const __m512 scale = _mm512_set1_ps(1.f / sqrtf((float)(16 * nv)));
    for (int v = 0; v < nv; v++) x[v] = _mm512_mul_ps(x[v], scale);
}
#endif

#endif
