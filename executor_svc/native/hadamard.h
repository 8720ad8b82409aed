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

#endif
