/* The x86 helpers more than one x86 file inlines (ggml keeps the like in
 * simd-mappings.h): static inline, so every kernel that calls them keeps them
 * inlined as it did in one file. Only the files under x86/ include this. */

#ifndef INFER_CPU_SIMD_H
#define INFER_CPU_SIMD_H

#include "../kernels.h"

#ifdef HAVE_X86

AVX2 static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* sum_g biases[g] * xs[g], eight groups at a time (one order for every caller). */
AVX2 static inline float bias_dot(const float *biases, const float *xs, Py_ssize_t groups) {
    __m256 a = _mm256_setzero_ps();
    Py_ssize_t g = 0;
    for (; g + 8 <= groups; g += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(biases + g), _mm256_loadu_ps(xs + g), a);
    float t = hsum(a);
    for (; g < groups; g++) t += biases[g] * xs[g];
    return t;
}

/* m (2..MAX_ROWS) as a constant for the M-row kernels (their accumulators stay in registers). */
#define ROWS_CASES(call) \
    switch (m) { \
    case 2: call(2); break; case 3: call(3); break; case 4: call(4); break; \
    case 5: call(5); break; case 6: call(6); break; case 7: call(7); break; default: call(8); break; \
    }

/* 16 bytes as 16 integer lanes (vpmovzxbd). */
AVX512 static inline __m512 codes16(const uint8_t *c) {
    return _mm512_castsi512_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)c)));
}

/* 16 8-bit codes as 16 floats. */
AVX512 static inline __m512 bytes16(const uint8_t *c) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)c)));
}

/* A decoded block (w0: its columns 0..15, w1: 16..31, as floats) against the
 * same columns of x (x0, x1), into acc: with g16 two groups of 16 (scales
 * s[0], s[1]), else one scale s[0]. The one formula of every AVX-512 row, so
 * that a row's sums do not depend on the rows it is computed with. */
AVX512 INLINE __m512 fold_512(__m512 w0, __m512 w1, const float *s, __m512 x0, __m512 x1, __m512 acc, const int g16) {
    __m512 t = _mm512_mul_ps(w0, x0);
    if (g16)
        return _mm512_fmadd_ps(_mm512_set1_ps(s[1]), _mm512_mul_ps(w1, x1), _mm512_fmadd_ps(_mm512_set1_ps(s[0]), t, acc));
    return _mm512_fmadd_ps(_mm512_set1_ps(s[0]), _mm512_fmadd_ps(w1, x1, t), acc);
}

/* One block of 32 codes c (bits 4, or 8) as floats: w0 its columns 0..15, w1 16..31
 * (4 bits: the low nibbles through the table, the high ones after a shift). */
AVX512 INLINE void decode_512(const uint8_t *c, __m512 table, __m512 *w0, __m512 *w1, const int bits) {
    if (bits == 4) {
        __m512i b = _mm512_castps_si512(codes16(c));
        *w0 = _mm512_permutexvar_ps(b, table), *w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table);
    } else {
        *w0 = bytes16(c), *w1 = bytes16(c + 16);
    }
}

#endif
#endif
