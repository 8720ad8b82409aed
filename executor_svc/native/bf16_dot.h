/* VDPBF16PS's arithmetic in AVX-512F, for CPUs without AVX512-BF16 (and for
 * tests of the kernels built on it, on every AVX-512 CPU).
 *
 * Each 32-bit lane of a and b holds two bfloat16 values; Intel's definition:
 *
 *     acc += a.hi * b.hi;  acc += a.lo * b.lo
 *
 * two float32 FMAs, the odd (high) element first. A product of two bfloat16
 * values is exact in float32, so each step rounds once, as the instruction
 * does. Equal to it for normal values: the instruction also flushes denormal
 * inputs and results to zero, this does not.
 *
 * Included by source files; native_build.py hashes the headers a source
 * includes into its build key, so editing this rebuilds them. */
#ifndef PAGEDSERVE_BF16_DOT_H
#define PAGEDSERVE_BF16_DOT_H
#include <immintrin.h>

static inline __attribute__((always_inline)) __m512 dot_emulated(__m512 acc, __m512i a, __m512i b)
{
    const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
    acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(a, high)),
                          _mm512_castsi512_ps(_mm512_and_si512(b, high)), acc);
    return _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(a, 16)),
                           _mm512_castsi512_ps(_mm512_slli_epi32(b, 16)), acc);
}

#endif
