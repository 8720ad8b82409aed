/* ln x on 16 floats at once, for the native kernels built with AVX-512.
 *
 * x = m 2^e with m in [sqrt(1/2), sqrt(2)) (getmant/getexp, then one halving
 * step), ln m = 2 atanh(s), s = (m - 1) / (m + 1), |s| <= 0.172, by its
 * series to s^9 (truncation < 3e-9 relative), plus e ln 2. Inputs next to
 * 1 stay exact (s is then tiny). Measured against float64 with a standalone
 * build (twenty-first session): within 2.5 ulp for ln u at every u the
 * sampler's hash makes (2^-24 .. 1 - 2^-24), 2.8 ulp for ln E down to
 * E ~ 6e-8. Zero, negative, denormal, infinite and NaN inputs are outside its
 * contract: callers pass positive normal floats (race_rows_f32's uniforms
 * and their -ln).
 *
 * Included by source files; native_build.py hashes the headers a source
 * includes into its build key, so editing this rebuilds them. */
#ifndef PAGEDSERVE_LOG512_H
#define PAGEDSERVE_LOG512_H
#include <immintrin.h>

static inline __m512 log512(__m512 x)
{
    __m512 m = _mm512_getmant_ps(x, _MM_MANT_NORM_1_2, _MM_MANT_SIGN_src); /* [1, 2) */
    __m512 e = _mm512_getexp_ps(x);
    const __mmask16 high = _mm512_cmp_ps_mask(m, _mm512_set1_ps(1.41421356f), _CMP_GT_OQ);
    m = _mm512_mask_mul_ps(m, high, m, _mm512_set1_ps(0.5f));
    e = _mm512_mask_add_ps(e, high, e, _mm512_set1_ps(1.0f));
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512 s = _mm512_div_ps(_mm512_sub_ps(m, one), _mm512_add_ps(m, one));
    const __m512 s2 = _mm512_mul_ps(s, s);
    __m512 p = _mm512_set1_ps(1.f / 9);
    p = _mm512_fmadd_ps(p, s2, _mm512_set1_ps(1.f / 7));
    p = _mm512_fmadd_ps(p, s2, _mm512_set1_ps(1.f / 5));
    p = _mm512_fmadd_ps(p, s2, _mm512_set1_ps(1.f / 3));
    p = _mm512_fmadd_ps(p, s2, one);
    const __m512 ln_m = _mm512_mul_ps(_mm512_add_ps(s, s), p);
    /* ln 2 in two parts (as exp512.h): e ln2_hi is exact for |e| < 2^12. */
    const __m512 hi = _mm512_fmadd_ps(e, _mm512_set1_ps(0.693145751953125f), ln_m);
    return _mm512_fmadd_ps(e, _mm512_set1_ps(1.428606765330187e-06f), hi);
}

#endif
