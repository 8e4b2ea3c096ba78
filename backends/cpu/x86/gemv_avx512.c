/* -- AVX-512F ---------------------------------------------------------------------
 *
 * The 4-bit products of the AVX2 path (the same formula, float32 sums in
 * another order), with fewer instructions per code byte, so that decoding is
 * bound by memory rather than by instruction issue:
 *
 * 4-bit codes: the 16 bytes of a block are zero-extended to 16 lanes in one
 * load (vpmovzxbd); vpermps indexes a 16-entry table by the low 4 bits of each
 * lane, so the table {0.0, ..., 15.0} turns the low nibbles (the block's
 * columns 0..15) into floats directly, and the high nibbles (columns 16..31)
 * after one shift: no mask, no conversion, and x is read in its own order:
 * each block is lo * x[0:16] + hi * x[16:32].
 *
 * Decoding (one activation row) takes short 4-bit rows WROWS at a time: each
 * block of x is loaded once for all of them, and the row loop's, the
 * prefetches' and the call's costs are shared. A 576-column row is only 18
 * blocks, and these costs were a tenth of its time in a decode step (SmolLM2's
 * 576-column products 1.08-1.11x faster; docs/performance.md). Longer rows, and
 * 8-bit ones, measured slower so (0.72-0.93x: 4 or 2 rows read at once from
 * memory a few hundred bytes apart), and go one at a time. Each row's sums are
 * those it gets alone (even blocks into one accumulator, odd blocks into the
 * other), so its result does not depend on its neighbours.
 *
 * 8-bit codes: 16 at a time zero-extended (vpmovzxbd) and converted
 * (vcvtdq2ps); against the AVX2 rows, 1.2-1.4x faster in a decode step
 * (Gemma 3's and SmolLM2's heads, Gemma 3's Q5_0 and Q6_K layers).
 *
 * Per block the scale multiplies the block's sum once and the bias term is
 * sum_g bias[g] * sum(x in g) (bias_dot), as everywhere else. */


#include "simd.h"

#ifdef HAVE_X86
/* One block of 32 codes against its columns of x (x0 the first 16, x1 the next), into acc. */
AVX512 INLINE __m512 block_512(const uint8_t *c, const float *s, __m512 x0, __m512 x1, __m512 acc, __m512 table,
                               const int bits, const int g16) {
    __m512 w0, w1;
    decode_512(c, table, &w0, &w1, bits);
    return fold_512(w0, w1, s, x0, x1, acc, g16);
}

/* R weight rows (row_bytes apart; their scales and biases k / group apart)
 * against one activation row x: out[r] for r < R. R a constant (1..WROWS), so
 * that the 2 x R accumulators stay in registers. */
AVX512 INLINE void wrows_512(const uint8_t *codes, Py_ssize_t row_bytes, const float *scales, const float *biases,
                             const float *x, const float *xs, float *out, Py_ssize_t k, const int R, const int bits,
                             const int g16) {
    const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    Py_ssize_t blocks = k / GROUP, step = bits == 4 ? GROUP / 2 : GROUP, per = g16 ? 2 : 1, groups = blocks * per, g = 0;
    __m512 even[WROWS], odd[WROWS];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) even[r] = odd[r] = _mm512_setzero_ps();
    for (; g + 1 < blocks; g += 2) {
        const float *v = x + g * GROUP;
        __m512 x0 = _mm512_loadu_ps(v), x1 = _mm512_loadu_ps(v + 16);
        __m512 x2 = _mm512_loadu_ps(v + 32), x3 = _mm512_loadu_ps(v + 48);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const uint8_t *c = codes + r * row_bytes + g * step;
            const float *sc = scales + r * groups + g * per;
            even[r] = block_512(c, sc, x0, x1, even[r], table, bits, g16);
            odd[r] = block_512(c + step, sc + per, x2, x3, odd[r], table, bits, g16);
        }
    }
    if (g < blocks) {
        __m512 x0 = _mm512_loadu_ps(x + g * GROUP), x1 = _mm512_loadu_ps(x + g * GROUP + 16);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
            even[r] = block_512(codes + r * row_bytes + g * step, scales + r * groups + g * per, x0, x1, even[r], table,
                                bits, g16);
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
        out[r] = _mm512_reduce_add_ps(_mm512_add_ps(even[r], odd[r])) + bias_dot(biases + r * groups, xs, groups);
}

#define WROWS_CASES(B, G) \
    switch (n - r < wr ? n - r : wr) { \
    case 1: wrows_512(c, row_bytes, sr, br, x, xs, out + r, k, 1, B, G); break; \
    case 2: wrows_512(c, row_bytes, sr, br, x, xs, out + r, k, 2, B, G); break; \
    case 3: wrows_512(c, row_bytes, sr, br, x, xs, out + r, k, 3, B, G); break; \
    default: wrows_512(c, row_bytes, sr, br, x, xs, out + r, k, WROWS, B, G); break; \
    }

/* Weight rows [0, n) of a tile (widened scales and biases s, bi) against one
 * activation row, wr (1..WROWS) at a time, the codes PREFETCH bytes ahead asked
 * for (the hardware prefetchers stop at 4 KiB pages); `left`: code bytes from
 * these rows' start to the matrix's end, past which nothing is prefetched. */
AVX512 void tile_512(int bits, Py_ssize_t group, int wr, const uint8_t *codes, const float *s, const float *bi,
                     const float *x, const float *xs, float *out, Py_ssize_t n, Py_ssize_t k, Py_ssize_t left) {
    Py_ssize_t row_bytes = bits == 4 ? k / 2 : k, groups = k / group, r = 0;
    for (; r < n; r += wr) {
        Py_ssize_t here = (n - r < wr ? n - r : wr) * row_bytes, at = r * row_bytes;
        for (Py_ssize_t b = 0; b < here && at + PREFETCH + b < left; b += 64)
            __builtin_prefetch((const char *)codes + at + PREFETCH + b, 0, PREFETCH_LOCALITY);
        const uint8_t *c = codes + at;
        const float *sr = s + r * groups, *br = bi + r * groups;
        if (bits == 4) {
            WROWS_CASES(4, 0)
        } else if (group == 16) {
            WROWS_CASES(8, 1)
        } else {
            WROWS_CASES(8, 0)
        }
    }
}

/* One block of codes c (scales sc), decoded once, into each of the M rows' accumulators. */
AVX512 INLINE void block_rows_512(const uint8_t *c, const float *sc, const float *x, Py_ssize_t k, __m512 table,
                                  __m512 *acc, const int M, const int bits, const int g16) {
    __m512 w0, w1;
    decode_512(c, table, &w0, &w1, bits);
#pragma GCC unroll 8
    for (int i = 0; i < M; i++)
        acc[i] = fold_512(w0, w1, sc, _mm512_loadu_ps(x + i * k), _mm512_loadu_ps(x + i * k + 16), acc[i], g16);
}

/* M activation rows against one weight row: each block decoded once for all M
 * rows, M a constant (2..MAX_ROWS) so that the 2 x M accumulators live in
 * registers. Each row's sums are those of wrows_512 (even blocks into one
 * accumulator, odd into the other), so a row's result does not depend on how
 * many rows share the call. */
AVX512 INLINE void rows_512(const uint8_t *codes, const float *scales, const float *biases, const float *x,
                            const float *xs, float *out, Py_ssize_t k, Py_ssize_t n, const int M, const int bits,
                            const int g16) {
    const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    Py_ssize_t blocks = k / GROUP, step = bits == 4 ? GROUP / 2 : GROUP, per = g16 ? 2 : 1, groups = blocks * per, g = 0;
    __m512 even[MAX_ROWS], odd[MAX_ROWS]; /* (named per parity, not indexed by g & 1: kept in registers) */
#pragma GCC unroll 8
    for (int i = 0; i < M; i++) even[i] = odd[i] = _mm512_setzero_ps();
    for (; g + 1 < blocks; g += 2) {
        block_rows_512(codes + g * step, scales + g * per, x + g * GROUP, k, table, even, M, bits, g16);
        block_rows_512(codes + (g + 1) * step, scales + (g + 1) * per, x + (g + 1) * GROUP, k, table, odd, M, bits, g16);
    }
    if (g < blocks) block_rows_512(codes + g * step, scales + g * per, x + g * GROUP, k, table, even, M, bits, g16);
#pragma GCC unroll 8
    for (int i = 0; i < M; i++)
        out[i * n] = _mm512_reduce_add_ps(_mm512_add_ps(even[i], odd[i])) + bias_dot(biases, xs + i * groups, groups);
}

AVX512 void row4_avx512(const uint8_t *codes, const float *scales, const float *biases, const float *x,
                        const float *xs, float *out, Py_ssize_t m, Py_ssize_t k, Py_ssize_t n,
                        Py_ssize_t group) {
    (void)group; /* always 32 */
    if (m == 1) {
        wrows_512(codes, k / 2, scales, biases, x, xs, out, k, 1, 4, 0);
        return;
    }
#define CALL4(M) rows_512(codes, scales, biases, x, xs, out, k, n, M, 4, 0)
    ROWS_CASES(CALL4)
}

AVX512 void row8_avx512(const uint8_t *codes, const float *scales, const float *biases, const float *x,
                        const float *xs, float *out, Py_ssize_t m, Py_ssize_t k, Py_ssize_t n,
                        Py_ssize_t group) {
    if (m == 1) {
        if (group == 16) wrows_512(codes, k, scales, biases, x, xs, out, k, 1, 8, 1);
        else wrows_512(codes, k, scales, biases, x, xs, out, k, 1, 8, 0);
        return;
    }
#define CALL8G16(M) rows_512(codes, scales, biases, x, xs, out, k, n, M, 8, 1)
#define CALL8(M) rows_512(codes, scales, biases, x, xs, out, k, n, M, 8, 0)
    if (group == 16) {
        ROWS_CASES(CALL8G16)
    } else {
        ROWS_CASES(CALL8)
    }
}

/* The same, sixteen at a time (AVX-512F's vcvtph2ps). */
AVX512 void halves_512(const uint16_t *h, float *f, Py_ssize_t n) {
    Py_ssize_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(f + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + i))));
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(f + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
    for (; i < n; i++) f[i] = half_to_float(h[i]);
}
#endif
