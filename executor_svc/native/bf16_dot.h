/* VDPBF16PS's arithmetic in AVX-512F, for CPUs without AVX512-BF16 (and for
 * tests of the kernels built on it, on every AVX-512 CPU).
 *
 * Each 32-bit lane of a and b holds two bfloat16 values; Intel's definition:
 *
 *     acc += a.hi * b.hi;  acc += a.lo * b.lo
 *
 * two float32 FMAs, the odd (high) element first. A product of two bfloat16
 * values is exact in float32, so each step rounds once, as that definition
 * does. Hardware need not follow it bit for bit: the instruction flushes
 * denormal inputs and results to zero (this does not), and results recorded
 * on an AMD EPYC 9454 do not all match Intel's SDE or an emulation of
 * Intel's definition (simd-everywhere/simde#1095). So the tests that compare
 * the two (*_agrees_with_its_emulation) allow about one rounding per pair,
 * never asserting bit equality; a mis-paired operand is thousands of times
 * larger than that.
 *
 * Included by source files; native_build.py hashes the headers a source
 * includes into its build key, so editing this rebuilds them. */
#ifndef PAGEDSERVE_BF16_DOT_H
#define PAGEDSERVE_BF16_DOT_H
#include <immintrin.h>

/* The instruction, where this compiler can build it: gcc 10+ only (the
 * compiler native_build looks for). An older clang may lack "avx512bf16" in
 * __builtin_cpu_supports, and failing there would lose the whole library,
 * not just its dot kernels. A source instantiating its dot kernel with
 * DOT_NATIVE_OP must also check __builtin_cpu_supports("avx512bf16") before
 * calling it. */
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 10
#define HAVE_NATIVE_DOT 1
#define DOT_NATIVE_TARGET __attribute__((target("avx512f,avx512bf16")))
#define DOT_NATIVE_OP(acc, a, b) _mm512_dpbf16_ps(acc, (__m512bh)(a), (__m512bh)(b))
#endif

static inline __attribute__((always_inline)) __m512 dot_emulated(__m512 acc, __m512i a, __m512i b)
{
    const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
    acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(a, high)),
                          _mm512_castsi512_ps(_mm512_and_si512(b, high)), acc);
    return _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(a, 16)),
                           _mm512_castsi512_ps(_mm512_slli_epi32(b, 16)), acc);
}

/* The index vectors that put 32 values back in order after
 * _mm512_unpacklo_epi16 / unpackhi_epi16 interleaved two rows of them (within
 * 128-bit lanes: "lo" holds positions 0-3, 8-11, 16-19, 24-27 of the 32,
 * "hi" the rest): permutex2var(lo, unpack_order(0), hi) gives positions
 * 0..15, unpack_order(1) 16..31. Both dot kernels pair rows this way. */
static inline __m512i unpack_order(int second_half)
{
    return second_half ? _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31)
                       : _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
}

#endif
