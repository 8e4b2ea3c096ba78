/* The affine products' AVX2+FMA+F16C rows (gemv.c calls them per tile): the
 * portable rows' formula, eight columns a register, the sums in their own fixed
 * order (one_row's: even blocks into one accumulator, odd into the other). */

#include "simd.h"

#ifdef HAVE_X86

AVX2 static inline __m256 widen(__m128i bytes8) { /* the low 8 bytes as 8 floats */
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes8));
}

/* 8-bit codes with a scale per 16 columns: one block of 32, scales s[0], s[1]
 * (the codes widened from memory, simd.h's dot32_at). */
AVX2 static inline __m256 g16_at(const uint8_t *c, const float *v, const float *s, __m256 acc) {
    __m256 u, t = dot32_at(c, v, &u, 0);
    return _mm256_fmadd_ps(_mm256_broadcast_ss(s + 1), u, _mm256_fmadd_ps(_mm256_broadcast_ss(s), t, acc));
}

/* One activation row: two accumulators in registers, two groups per step
 * (the accumulator chain, not the loads, limits the loop otherwise); each
 * group's sum is nib32_at's or dot32_at's (simd.h), the M-row kernels' below. */
AVX2 static float one_row(int bits, const uint8_t *codes, const float *scales, const float *biases, const float *v,
                          const float *xs, Py_ssize_t k, Py_ssize_t group) {
    Py_ssize_t groups = k / GROUP, step = bits == 4 ? GROUP / 2 : GROUP, g = 0;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    if (group == 16) { /* groups here are blocks of 32 columns, two scales each */
        for (; g + 1 < groups; g += 2) {
            a0 = g16_at(codes + g * GROUP, v + g * GROUP, scales + 2 * g, a0);
            a1 = g16_at(codes + (g + 1) * GROUP, v + (g + 1) * GROUP, scales + 2 * (g + 1), a1);
        }
        if (g < groups) a0 = g16_at(codes + g * GROUP, v + g * GROUP, scales + 2 * g, a0);
        return hsum(_mm256_add_ps(a0, a1)) + bias_dot(biases, xs, 2 * groups);
    }
    if (bits == 4) {
        for (; g + 1 < groups; g += 2) {
            a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(scales + g), nib32_at(codes + g * step, v + g * GROUP), a0);
            a1 = _mm256_fmadd_ps(_mm256_broadcast_ss(scales + g + 1), nib32_at(codes + (g + 1) * step, v + (g + 1) * GROUP), a1);
        }
        if (g < groups) a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(scales + g), nib32_at(codes + g * step, v + g * GROUP), a0);
    } else {
        for (; g + 1 < groups; g += 2) {
            a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(scales + g), dot32_at(codes + g * step, v + g * GROUP, NULL, 0), a0);
            a1 = _mm256_fmadd_ps(_mm256_broadcast_ss(scales + g + 1), dot32_at(codes + (g + 1) * step, v + (g + 1) * GROUP, NULL, 0), a1);
        }
        if (g < groups) a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(scales + g), dot32_at(codes + g * step, v + g * GROUP, NULL, 0), a0);
    }
    return hsum(_mm256_add_ps(a0, a1)) + bias_dot(biases, xs, groups);
}

/* M activation rows against one weight row: each block widened once for all M
 * rows, M a constant (2..MAX_ROWS) and the accumulators named per parity (an
 * array indexed by g & 1 is kept in memory), so they stay in registers. The
 * sums and their order are one_row's (even blocks into one accumulator, odd
 * into the other), so a row's result does not depend on how many rows share
 * the call. */

/* One block of 32 codes, widened (w0..w3), into each row's accumulator. */
AVX2 INLINE void block_rows(__m256 w0, __m256 w1, __m256 w2, __m256 w3, __m256 s, const float *x, Py_ssize_t k,
                            __m256 *acc, const int M) {
#pragma GCC unroll 8
    for (int i = 0; i < M; i++) {
        const float *v = x + i * k;
        __m256 t = _mm256_mul_ps(w0, _mm256_loadu_ps(v));
        t = _mm256_fmadd_ps(w1, _mm256_loadu_ps(v + 8), t);
        t = _mm256_fmadd_ps(w2, _mm256_loadu_ps(v + 16), t);
        t = _mm256_fmadd_ps(w3, _mm256_loadu_ps(v + 24), t);
        acc[i] = _mm256_fmadd_ps(s, t, acc[i]);
    }
}

/* The same for 8-bit codes with a scale per 16 columns (g16_at's order). */
AVX2 INLINE void block16_rows(__m256 w0, __m256 w1, __m256 w2, __m256 w3, __m256 s0, __m256 s1, const float *x,
                              Py_ssize_t k, __m256 *acc, const int M) {
#pragma GCC unroll 8
    for (int i = 0; i < M; i++) {
        const float *v = x + i * k;
        __m256 t = _mm256_mul_ps(w0, _mm256_loadu_ps(v));
        t = _mm256_fmadd_ps(w1, _mm256_loadu_ps(v + 8), t);
        __m256 u = _mm256_mul_ps(w2, _mm256_loadu_ps(v + 16));
        u = _mm256_fmadd_ps(w3, _mm256_loadu_ps(v + 24), u);
        acc[i] = _mm256_fmadd_ps(s1, u, _mm256_fmadd_ps(s0, t, acc[i]));
    }
}

AVX2 INLINE void widen_block(int bits, const uint8_t *codes, Py_ssize_t g, __m256 *w) {
    if (bits == 4)
        nibbles32_at(codes + g * (GROUP / 2), w);
    else
        codes32_at(codes + g * GROUP, w, 0);
}

AVX2 INLINE void one_block(int bits, const uint8_t *codes, const float *scales, const float *x, Py_ssize_t k,
                           Py_ssize_t group, Py_ssize_t g, __m256 *acc, const int M) {
    __m256 w[4];
    widen_block(bits, codes, g, w);
    if (group == 16)
        block16_rows(w[0], w[1], w[2], w[3], _mm256_broadcast_ss(scales + 2 * g), _mm256_broadcast_ss(scales + 2 * g + 1),
                     x + g * GROUP, k, acc, M);
    else
        block_rows(w[0], w[1], w[2], w[3], _mm256_broadcast_ss(scales + g), x + g * GROUP, k, acc, M);
}

AVX2 INLINE void rows_pass(int bits, const uint8_t *codes, const float *scales, const float *biases, const float *x,
                           const float *xs, float *out, Py_ssize_t k, Py_ssize_t n, Py_ssize_t group, const int M) {
    Py_ssize_t groups = k / GROUP, bias_groups = k / group, g = 0;
    __m256 even[MAX_ROWS], odd[MAX_ROWS];
#pragma GCC unroll 8
    for (int i = 0; i < M; i++) even[i] = odd[i] = _mm256_setzero_ps();
    for (; g + 1 < groups; g += 2) {
        one_block(bits, codes, scales, x, k, group, g, even, M);
        one_block(bits, codes, scales, x, k, group, g + 1, odd, M);
    }
    if (g < groups) one_block(bits, codes, scales, x, k, group, g, even, M);
#pragma GCC unroll 8
    for (int i = 0; i < M; i++)
        out[i * n] = hsum(_mm256_add_ps(even[i], odd[i])) + bias_dot(biases, xs + i * bias_groups, bias_groups);
}

/* More than ROWS_PASS rows go in two passes over the weight row (it stays in L1), each
 * pass's accumulators in registers: at 8 rows the 16 of one pass do not fit beside the
 * widened codes and spill (each updated through the stack every block). Two passes of
 * 4 measured 1.06-1.10x on Q4_K and 1.05-1.10x on Q6_K (2048 x 2048, two threads, both
 * builds in one process in both orders, Zen 3); at 5 to 7 rows, where fewer spill,
 * widening the codes twice cost more than it saved (0.90-1.06x). Each row's sums are
 * its own either way: the same bits. */
#ifndef ROWS_PASS
#define ROWS_PASS 7
#endif
AVX2 INLINE void rows_avx2(int bits, const uint8_t *codes, const float *scales, const float *biases, const float *x,
                           const float *xs, float *out, Py_ssize_t k, Py_ssize_t n, Py_ssize_t group, const int M) {
    if (M > ROWS_PASS) {
        const int first = (M + 1) / 2;
        const Py_ssize_t bias_groups = k / group;
        rows_pass(bits, codes, scales, biases, x, xs, out, k, n, group, first);
        rows_pass(bits, codes, scales, biases, x + first * k, xs + first * bias_groups, out + first * n, k, n, group,
                  M - first);
        return;
    }
    rows_pass(bits, codes, scales, biases, x, xs, out, k, n, group, M);
}

AVX2 void row4_avx2(const uint8_t *codes, const float *scales, const float *biases, const float *x,
                    const float *xs, float *out, Py_ssize_t m, Py_ssize_t k, Py_ssize_t n, Py_ssize_t group) {
    if (m == 1) {
        out[0] = one_row(4, codes, scales, biases, x, xs, k, group);
        return;
    }
#define CALL_ROWS4(M) rows_avx2(4, codes, scales, biases, x, xs, out, k, n, group, M)
    ROWS_CASES(CALL_ROWS4)
}

AVX2 void row8_avx2(const uint8_t *codes, const float *scales, const float *biases, const float *x,
                    const float *xs, float *out, Py_ssize_t m, Py_ssize_t k, Py_ssize_t n, Py_ssize_t group) {
    if (m == 1) {
        out[0] = one_row(8, codes, scales, biases, x, xs, k, group);
        return;
    }
#define CALL_ROWS8(M) rows_avx2(8, codes, scales, biases, x, xs, out, k, n, group, M)
    ROWS_CASES(CALL_ROWS8)
}

AVX2 void rowf_avx2(const float *w, const float *x, float *out, Py_ssize_t m, Py_ssize_t k, Py_ssize_t n) {
    Py_ssize_t c;
    if (m > 1) {  /* row by row, so each row's sum is the one-row sum (the weight row stays in L1) */
        for (Py_ssize_t i = 0; i < m; i++) rowf_avx2(w, x + i * k, out + i * n, 1, k, n);
        return;
    }
    {
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
        for (c = 0; c + 32 <= k; c += 32) {
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + c), _mm256_loadu_ps(x + c), a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + c + 8), _mm256_loadu_ps(x + c + 8), a1);
            a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w + c + 16), _mm256_loadu_ps(x + c + 16), a2);
            a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w + c + 24), _mm256_loadu_ps(x + c + 24), a3);
        }
        float acc = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
        for (; c < k; c++) acc += w[c] * x[c];
        out[0] = acc;
    }
}

/* One row of codes to float32, group by group (columns 0..15 of a 4-bit group in the low nibbles). */
AVX2 void dequant_row_avx2(int bits, const uint8_t *codes, const float *scales, const float *biases,
                           float *out, Py_ssize_t k, Py_ssize_t group) {
    const __m128i low = _mm_set1_epi8(15);
    if (group != GROUP) { /* 8-bit codes, groups of 16: eight columns at a time */
        for (Py_ssize_t c = 0; c < k; c += 8) {
            __m256 sc = _mm256_broadcast_ss(scales + c / group), b = _mm256_broadcast_ss(biases + c / group);
            __m128i v = _mm_loadl_epi64((const __m128i *)(codes + c));
            _mm256_storeu_ps(out + c, _mm256_add_ps(_mm256_mul_ps(widen(v), sc), b));
        }
        return;
    }
    for (Py_ssize_t g = 0; g < k / GROUP; g++) {
        __m256 sc = _mm256_broadcast_ss(scales + g), b = _mm256_broadcast_ss(biases + g);
        float *o = out + g * GROUP;
        __m128i c0, c1; /* columns 0..15 and 16..31 of the group, a byte each */
        if (bits == 4) {
            __m128i v = _mm_loadu_si128((const __m128i *)(codes + g * (GROUP / 2)));
            c0 = _mm_and_si128(v, low), c1 = _mm_and_si128(_mm_srli_epi16(v, 4), low);
        } else {
            const uint8_t *c = codes + g * GROUP;
            c0 = _mm_loadu_si128((const __m128i *)c), c1 = _mm_loadu_si128((const __m128i *)(c + 16));
        }
        _mm256_storeu_ps(o, _mm256_add_ps(_mm256_mul_ps(widen(c0), sc), b));
        _mm256_storeu_ps(o + 8, _mm256_add_ps(_mm256_mul_ps(widen(_mm_srli_si128(c0, 8)), sc), b));
        _mm256_storeu_ps(o + 16, _mm256_add_ps(_mm256_mul_ps(widen(c1), sc), b));
        _mm256_storeu_ps(o + 24, _mm256_add_ps(_mm256_mul_ps(widen(_mm_srli_si128(c1, 8)), sc), b));
    }
}

/* n float16 values to float32 (F16C on the AVX2 path). */
AVX2 void halves_f16c(const uint16_t *h, float *f, Py_ssize_t n) {
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(f + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
    for (; i < n; i++) f[i] = half_to_float(h[i]);
}
#endif
