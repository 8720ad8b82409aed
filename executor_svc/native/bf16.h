/* bfloat16 <-> float32 for 16 lanes at once, with AVX-512F integer ops only
 * (no AVX512-BF16, no AVX512-BW), so every AVX-512 CPU runs the same code and
 * gets the same bits.
 *
 * A bfloat16 is the top half of a float32: widening is a shift, exactly.
 * Narrowing rounds to nearest, ties to even, as torch's c10::BFloat16 does
 * (round_to_nearest_even): add 0x7FFF plus the kept part's lowest bit, keep
 * the top half; a NaN becomes 0x7FC0. Infinities stay infinite, and values
 * that round past the largest bfloat16 become infinite, as in torch.
 * _mm512_cvtneps_pbh (AVX512-BF16) is not used: it treats subnormal inputs
 * as zero, so its bits differ from torch's for them.
 *
 * Rows whose length is not a multiple of 16 end in a partial vector: masked
 * 16-bit loads and stores need AVX512-BW, so the tail goes through a 16-lane
 * stack buffer instead (the _n functions take the count left in the row).
 *
 * Included by source files; native_build.py hashes the headers a source
 * includes into its build key, so editing this rebuilds them. */
#ifndef PAGEDSERVE_BF16_H
#define PAGEDSERVE_BF16_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

static inline __m512 bf16_widen(__m256i h)
{
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline __m256i bf16_round(__m512 x)
{
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(r); /* each lane now fits 16 bits: a plain truncating pack */
}

/* x rounded to bfloat16 and widened back: the value torch's bf16 op stores. */
static inline __m512 bf16_rounded(__m512 x)
{
    return bf16_widen(bf16_round(x));
}

/* The next min(n, 16) elements at p (n >= 1 remain in the row), zeros in
 * the lanes past them. */
static inline __m256i bf16_load_bits(const uint16_t *p, int n)
{
    if (n >= 16)
        return _mm256_loadu_si256((const __m256i *)p);
    uint16_t buf[16] = {0};
    memcpy(buf, p, (size_t)n * sizeof(uint16_t));
    return _mm256_loadu_si256((const __m256i *)buf);
}

static inline __m512 bf16_load_n(const uint16_t *p, int n)
{
    return bf16_widen(bf16_load_bits(p, n));
}

/* Stores the first min(n, 16) lanes of h, and nothing past them. */
static inline void bf16_store_bits(uint16_t *p, __m256i h, int n)
{
    if (n >= 16) {
        _mm256_storeu_si256((__m256i *)p, h);
        return;
    }
    uint16_t buf[16];
    _mm256_storeu_si256((__m256i *)buf, h);
    memcpy(p, buf, (size_t)n * sizeof(uint16_t));
}

static inline void bf16_store_n(uint16_t *p, __m512 x, int n)
{
    bf16_store_bits(p, bf16_round(x), n);
}

#endif
