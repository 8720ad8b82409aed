/* e^x on 16 floats at once, for the native kernels built with AVX-512.
 *
 * x = n ln2 + r with |r| <= ln2/2; e^r by its degree-6 Taylor series
 * (truncation error < 2e-7 relative), scaled by 2^n with scalef. About
 * 2 ulp. Inputs below -87 are raised to it, so e^-87 ~ 1.6e-38 stands in for
 * 0 (no denormals); above ~88.7 the result is +inf; a NaN comes out NaN
 * (VMAXPS returns its second operand when either is NaN, so x goes second):
 * attention's softmax relies on that to carry a NaN score into its sums
 * rather than weigh it as zero. Inline,
 * unlike libm's expf, so the caller's registers stay live and its loops
 * vectorize.
 *
 * Included by source files; native_build.py hashes the headers a source
 * includes into its build key, so editing this rebuilds them. */
#ifndef PAGEDSERVE_EXP512_H
#define PAGEDSERVE_EXP512_H
#include <immintrin.h>

static inline __m512 exp512(__m512 x)
{
    x = _mm512_max_ps(_mm512_set1_ps(-87.0f), x);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693145751953125f), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(-1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

/* silu(g) = g / (1 + e^-g) on 16 floats, in the one operation order the
 * SwiGLU kernels share (fused_ops.c, fused_ops_bf16.c, bf16_dot_gemm.h), so
 * that a fused and an unfused gate give the same bits. */
static inline __m512 silu512(__m512 g)
{
    return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), g))));
}

#endif
