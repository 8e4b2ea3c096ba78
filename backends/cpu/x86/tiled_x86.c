/* The exact many-row products' micro-kernels and tile transposes on AVX2 and
 * AVX-512 (tiled.c: the loop around them and the portable forms). */

#include "simd.h"

#ifdef HAVE_X86
/* An 8 x 8 block of floats transposed in registers (r[j] row j in, column j out). */
AVX2 INLINE void transpose8(__m256 *r) {
    __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    __m256 s0 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0)), s1 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
    __m256 s2 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0)), s3 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
    __m256 s4 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(1, 0, 1, 0)), s5 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(3, 2, 3, 2));
    __m256 s6 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(1, 0, 1, 0)), s7 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(3, 2, 3, 2));
    r[0] = _mm256_permute2f128_ps(s0, s4, 0x20), r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
    r[2] = _mm256_permute2f128_ps(s2, s6, 0x20), r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
    r[4] = _mm256_permute2f128_ps(s0, s4, 0x31), r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
    r[6] = _mm256_permute2f128_ps(s2, s6, 0x31), r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

/* tile [kc][nr] = rows [nr][k] from column c0 (nr and kc multiples of 8), 8 x 8 blocks at a time. */
AVX2 void transpose_avx2(const float *rows, Py_ssize_t k, Py_ssize_t c0, Py_ssize_t kc, Py_ssize_t nr, float *tile) {
    for (Py_ssize_t rb = 0; rb < nr; rb += 8)
        for (Py_ssize_t cb = 0; cb < kc; cb += 8) {
            __m256 r[8];
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) r[j] = _mm256_loadu_ps(rows + (rb + j) * k + c0 + cb);
            transpose8(r);
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) _mm256_storeu_ps(tile + (cb + j) * nr + rb, r[j]);
        }
}

/* M rows of x (packed: column c of row i at x[c * TILED_MR_512 + i]) against a tile [kc][32] (64-byte aligned): the M x 32
 * sums in 2 M zmm registers, one broadcast of x and two fused multiply-adds per
 * row and column. y's rows ldy apart; lanes k0 (columns 0..15) and k1 (16..31)
 * written; `first`: the sums start at zero, else at y. M a constant. */
AVX512 INLINE void micro_rows_512(const float *tile, Py_ssize_t kc, const float *x, float *y,
                                  Py_ssize_t ldy, const int M, __mmask16 k0, __mmask16 k1, int first) {
    __m512 a[TILED_MR_512], b[TILED_MR_512];
#pragma GCC unroll 12
    for (int i = 0; i < M; i++) {
        if (first) {
            a[i] = b[i] = _mm512_setzero_ps();
        } else {
            a[i] = _mm512_maskz_loadu_ps(k0, y + i * ldy);
            b[i] = _mm512_maskz_loadu_ps(k1, y + i * ldy + 16);
        }
    }
    for (Py_ssize_t c = 0; c < kc; c++) {
        const __m512 w0 = _mm512_load_ps(tile + c * 32), w1 = _mm512_load_ps(tile + c * 32 + 16);
#pragma GCC unroll 12
        for (int i = 0; i < M; i++) {
            const __m512 v = _mm512_set1_ps(x[c * TILED_MR_512 + i]);
            a[i] = _mm512_fmadd_ps(v, w0, a[i]);
            b[i] = _mm512_fmadd_ps(v, w1, b[i]);
        }
    }
#pragma GCC unroll 12
    for (int i = 0; i < M; i++) {
        _mm512_mask_storeu_ps(y + i * ldy, k0, a[i]);
        _mm512_mask_storeu_ps(y + i * ldy + 16, k1, b[i]);
    }
}

AVX512 void micro_512(const float *tile, Py_ssize_t kc, const float *x, float *y, Py_ssize_t ldy,
                      Py_ssize_t rows, Py_ssize_t valid, int first) {
    const __mmask16 k0 = valid >= 16 ? 0xffff : (__mmask16)((1u << valid) - 1);
    const __mmask16 k1 = valid >= 32 ? 0xffff : valid > 16 ? (__mmask16)((1u << (valid - 16)) - 1) : 0;
#define MICRO512(M) case M: micro_rows_512(tile, kc, x, y, ldy, M, k0, k1, first); break;
    switch (rows) {
    MICRO512(1) MICRO512(2) MICRO512(3) MICRO512(4) MICRO512(5) MICRO512(6)
    MICRO512(7) MICRO512(8) MICRO512(9) MICRO512(10) MICRO512(11) default: micro_rows_512(tile, kc, x, y, ldy, 12, k0, k1, first);
    }
#undef MICRO512
}

/* The same on AVX2 against a tile [kc][16] (x packed TILED_MR_AVX2 rows a column): M x 16 sums in 2 M ymm registers;
 * `valid` of the 16 columns written (the last panel's), through a buffer. */
AVX2 INLINE void micro_rows_avx2(const float *tile, Py_ssize_t kc, const float *x, float *y,
                                 Py_ssize_t ldy, const int M, Py_ssize_t valid, int first) {
    __m256 a[TILED_MR_AVX2], b[TILED_MR_AVX2];
    float part[16];
#pragma GCC unroll 6
    for (int i = 0; i < M; i++) {
        if (first) {
            a[i] = b[i] = _mm256_setzero_ps();
        } else if (valid == 16) {
            a[i] = _mm256_loadu_ps(y + i * ldy), b[i] = _mm256_loadu_ps(y + i * ldy + 8);
        } else {
            memset(part, 0, sizeof part);
            memcpy(part, y + i * ldy, (size_t)valid * sizeof(float));
            a[i] = _mm256_loadu_ps(part), b[i] = _mm256_loadu_ps(part + 8);
        }
    }
    for (Py_ssize_t c = 0; c < kc; c++) {
        const __m256 w0 = _mm256_load_ps(tile + c * 16), w1 = _mm256_load_ps(tile + c * 16 + 8);
#pragma GCC unroll 6
        for (int i = 0; i < M; i++) {
            const __m256 v = _mm256_broadcast_ss(x + c * TILED_MR_AVX2 + i);
            a[i] = _mm256_fmadd_ps(v, w0, a[i]);
            b[i] = _mm256_fmadd_ps(v, w1, b[i]);
        }
    }
#pragma GCC unroll 6
    for (int i = 0; i < M; i++) {
        if (valid == 16) {
            _mm256_storeu_ps(y + i * ldy, a[i]), _mm256_storeu_ps(y + i * ldy + 8, b[i]);
        } else {
            _mm256_storeu_ps(part, a[i]), _mm256_storeu_ps(part + 8, b[i]);
            memcpy(y + i * ldy, part, (size_t)valid * sizeof(float));
        }
    }
}

AVX2 void micro_avx2(const float *tile, Py_ssize_t kc, const float *x, float *y, Py_ssize_t ldy,
                     Py_ssize_t rows, Py_ssize_t valid, int first) {
#define MICROAVX2(M) case M: micro_rows_avx2(tile, kc, x, y, ldy, M, valid, first); break;
    switch (rows) {
    MICROAVX2(1) MICROAVX2(2) MICROAVX2(3) MICROAVX2(4) MICROAVX2(5) default: micro_rows_avx2(tile, kc, x, y, ldy, 6, valid, first);
    }
#undef MICROAVX2
}
#endif
