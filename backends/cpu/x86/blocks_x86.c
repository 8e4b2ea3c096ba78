/* GGML's blocks on AVX2 and AVX-512 (the portable decoders: blocks.c): the
 * tile decoders (the same bytes and float32 scales as blocks.c's), and for
 * decoding the kernels that decode a row's blocks in registers and multiply
 * it at once (gemv.c picks them for one activation row). */

#include "simd.h"

#ifdef HAVE_X86
AVX2 INLINE void q5_codes_avx2(const uint8_t *qh4, const uint8_t *qs, uint8_t *o) {
    _mm256_storeu_si256((__m256i *)o, q5_vector(qh4, qs));
}

/* blocks.c's decode_codes, 16 or 32 bytes at a time (the same bytes). */
AVX2 INLINE void decode_codes_avx2(int type, const uint8_t *b, uint8_t *codes) {
    switch (type) {
    case GGML_Q4_0: case GGML_Q4_1: memcpy(codes, b + (type == GGML_Q4_0 ? 2 : 4), 16); return; /* a copy */
    case GGML_Q5_0: q5_codes_avx2(b + 2, b + 6, codes); return;
    case GGML_Q5_1: q5_codes_avx2(b + 4, b + 8, codes); return;
    case GGML_Q8_0:
        _mm256_storeu_si256((__m256i *)codes, _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(b + 2)),
                                                                _mm256_set1_epi8((char)0x80)));
        return;
    case GGML_Q4_K: {
        const __m128i m4 = _mm_set1_epi8(15), h4 = _mm_set1_epi8((char)0xF0);
        for (int i = 0; i < 4; i++) {
            __m128i a = _mm_loadu_si128((const __m128i *)(b + 16 + 32 * i));
            __m128i c = _mm_loadu_si128((const __m128i *)(b + 32 + 32 * i));
            _mm_storeu_si128((__m128i *)(codes + 32 * i),
                             _mm_or_si128(_mm_and_si128(a, m4), _mm_and_si128(_mm_slli_epi16(c, 4), h4)));
            _mm_storeu_si128((__m128i *)(codes + 32 * i + 16),
                             _mm_or_si128(_mm_and_si128(_mm_srli_epi16(a, 4), m4), _mm_and_si128(c, h4)));
        }
        return;
    }
    case GGML_Q5_K: {
        const __m256i m4 = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
        __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16));
        for (int i = 0; i < 4; i++) {
            __m256i q = _mm256_loadu_si256((const __m256i *)(b + 48 + 32 * i));
            /* bit 2i (2i + 1) of each qh byte: 16-bit shifts, then the byte's low bit */
            __m256i f0 = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * i)), one);
            __m256i f1 = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * i + 1)), one);
            _mm256_storeu_si256((__m256i *)(codes + 64 * i),
                                _mm256_or_si256(_mm256_and_si256(q, m4), _mm256_slli_epi16(f0, 4)));
            _mm256_storeu_si256((__m256i *)(codes + 64 * i + 32),
                                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 4), m4), _mm256_slli_epi16(f1, 4)));
        }
        return;
    }
    default: { /* Q6_K */
        const __m256i m4 = _mm256_set1_epi8(15), m30 = _mm256_set1_epi8(0x30);
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = b + 64 * h;
            __m256i l0 = _mm256_loadu_si256((const __m256i *)ql), l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
            __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
            uint8_t *o = codes + 128 * h;
            /* ((qh >> 2j) & 3) << 4 as one shift and a mask (bits crossing bytes are masked off) */
            _mm256_storeu_si256((__m256i *)o, _mm256_or_si256(_mm256_and_si256(l0, m4),
                                                              _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30)));
            _mm256_storeu_si256((__m256i *)(o + 32), _mm256_or_si256(_mm256_and_si256(l1, m4),
                                                                     _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30)));
            _mm256_storeu_si256((__m256i *)(o + 64), _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                                                                     _mm256_and_si256(qh, m30)));
            _mm256_storeu_si256((__m256i *)(o + 96), _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                                                     _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30)));
        }
    }
    }
}

AVX2 void decode_row_avx2(int type, const uint8_t *raw, Py_ssize_t blocks, Py_ssize_t block_bytes,
                          Py_ssize_t code_bytes, Py_ssize_t per, uint8_t *codes, float *s, float *bi) {
    for (Py_ssize_t j = 0; j < blocks; j++) {
        decode_codes_avx2(type, raw + j * block_bytes, codes + j * code_bytes);
        decode_scales_avx2(type, raw + j * block_bytes, s + j * per, bi + j * per);
    }
}

/* A Q5 block's fifth bits (qh, 4 bytes: bit i is column i's) added to its
 * columns' nibble values (w0: columns 0..15, w1: 16..31) as 16.0: exact. */
AVX512 INLINE void fifth_512(const uint8_t *qh, __m512 *w0, __m512 *w1) {
    uint32_t bits;
    memcpy(&bits, qh, 4);
    const __m512 sixteen = _mm512_set1_ps(16.0f);
    *w0 = _mm512_mask_add_ps(*w0, (__mmask16)(bits & 0xffff), *w0, sixteen);
    *w1 = _mm512_mask_add_ps(*w1, (__mmask16)(bits >> 16), *w1, sixteen);
}

AVX512 INLINE __m512 widen_lo(__m256i v) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(v))); }
AVX512 INLINE __m512 widen_hi(__m256i v) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(v, 1))); }

/* A 32-value block's codes as floats (w0: columns 0..15, w1: 16..31): the
 * 4-bit nibbles through the table as the converted 4-bit rows (Q5's fifth bits
 * added as 16), Q8_0's bytes widened as the 8-bit rows'. The same values. */
AVX512 INLINE void small_block_512(int type, const uint8_t *b, __m512 table, __m512 *w0, __m512 *w1) {
    if (type == GGML_Q8_0) {
        const __m256i c = small_codes(type, b);
        *w0 = widen_lo(c), *w1 = widen_hi(c);
        return;
    }
    const Py_ssize_t off = type == GGML_Q4_0 ? 2 : type == GGML_Q4_1 ? 4 : type == GGML_Q5_0 ? 6 : 8;
    decode_512(b + off, table, w0, w1, 4);
    if (type == GGML_Q5_0 || type == GGML_Q5_1) fifth_512(b + off - 4, w0, w1);
}

/* One activation row against one weight row of blocks, on AVX-512, decoding
 * in registers (no tile buffer): for decoding, where the tile's stores and
 * reloads cost more than the bytes they save. The arithmetic is wrows_512's
 * (R = 1) on the decoded form, step for step: per block of 32 columns
 * fold_512 of its columns 0..15 and 16..31 (the 4-bit ones through the same
 * table, the 8-bit ones widened alike), even blocks into one accumulator and
 * odd ones into the other; then bias_dot's sum, 8 groups at a time in order
 * and the last ones one by one. So the bits are wrows_512's. */
AVX512 INLINE float blocks_row_512(const int type, const uint8_t *raw, const float *x, const float *xs, Py_ssize_t k,
                                   Py_ssize_t pf) {
    const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();
    __m256 bacc = _mm256_setzero_ps();
    float s[16], pending[8]; /* s: eight 32-value blocks' scales; pending: the last (k / 32) % 8 blocks' biases */
    Py_ssize_t np_ = 0, gb = 0;      /* pending count; the group of pending[0] */
    if (type == GGML_Q4_K || type == GGML_Q5_K || type == GGML_Q6_K) {
        const Py_ssize_t bytes = type == GGML_Q4_K ? 144 : type == GGML_Q5_K ? 176 : 210, per = type == GGML_Q6_K ? 16 : 8;
        const Py_ssize_t blocks = k / QK_K;
        /* Each super-block's scales are unpacked one block ahead, into the other half of
         * these: the products then never wait on the stores they read them back from. */
        float ahead_s[2][16], ahead_b[2][16];
        decode_scales_avx2(type, raw, ahead_s[0], ahead_b[0]);
        for (Py_ssize_t j = 0; j < blocks; j++) {
            const uint8_t *b = raw + j * bytes;
            if (pf) ahead_of(b + pf, bytes);
            const float *v = x + j * QK_K;
            float *s = ahead_s[j & 1], *bi = ahead_b[j & 1];
            if (j + 1 < blocks) decode_scales_avx2(type, b + bytes, ahead_s[(j + 1) & 1], ahead_b[(j + 1) & 1]);
            bacc = _mm256_fmadd_ps(_mm256_loadu_ps(bi), _mm256_loadu_ps(xs + j * per), bacc);
            if (per == 16) bacc = _mm256_fmadd_ps(_mm256_loadu_ps(bi + 8), _mm256_loadu_ps(xs + j * per + 8), bacc);
            if (type == GGML_Q4_K) {
                for (int i = 0; i < 4; i++) { /* chunk i: groups 2i (low nibbles) and 2i + 1 (high) */
                    const uint8_t *q = b + 16 + 32 * i;
                    __m512i a = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
                    __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + 16)));
                    const float *w = v + 64 * i;
                    even = fold_512(_mm512_permutexvar_ps(a, table), _mm512_permutexvar_ps(c, table), s + 2 * i,
                                    _mm512_loadu_ps(w), _mm512_loadu_ps(w + 16), even, 0);
                    odd = fold_512(_mm512_permutexvar_ps(_mm512_srli_epi32(a, 4), table),
                                   _mm512_permutexvar_ps(_mm512_srli_epi32(c, 4), table), s + 2 * i + 1,
                                   _mm512_loadu_ps(w + 32), _mm512_loadu_ps(w + 48), odd, 0);
                }
            } else if (type == GGML_Q5_K) {
                const __m256i m4 = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
                __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16));
                for (int i = 0; i < 4; i++) {
                    __m256i q = _mm256_loadu_si256((const __m256i *)(b + 48 + 32 * i));
                    __m256i f0 = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * i)), one);
                    __m256i f1 = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * i + 1)), one);
                    __m256i lo = _mm256_or_si256(_mm256_and_si256(q, m4), _mm256_slli_epi16(f0, 4));
                    __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 4), m4), _mm256_slli_epi16(f1, 4));
                    const float *w = v + 64 * i;
                    even = fold_512(widen_lo(lo), widen_hi(lo), s + 2 * i, _mm512_loadu_ps(w), _mm512_loadu_ps(w + 16),
                                    even, 0);
                    odd = fold_512(widen_lo(hi), widen_hi(hi), s + 2 * i + 1, _mm512_loadu_ps(w + 32),
                                   _mm512_loadu_ps(w + 48), odd, 0);
                }
            } else { /* Q6_K: per half, four blocks of 32 (groups of 16, two scales each) */
                const __m256i m4 = _mm256_set1_epi8(15), m30 = _mm256_set1_epi8(0x30);
                for (int h = 0; h < 2; h++) {
                    const uint8_t *ql = b + 64 * h;
                    __m256i l0 = _mm256_loadu_si256((const __m256i *)ql), l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
                    __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
                    __m256i c0 = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30));
                    __m256i c1 = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30));
                    __m256i c2 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(qh, m30));
                    __m256i c3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                                 _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30));
                    const float *w = v + 128 * h, *sh = s + 8 * h;
                    even = fold_512(widen_lo(c0), widen_hi(c0), sh, _mm512_loadu_ps(w), _mm512_loadu_ps(w + 16), even, 1);
                    odd = fold_512(widen_lo(c1), widen_hi(c1), sh + 2, _mm512_loadu_ps(w + 32), _mm512_loadu_ps(w + 48), odd, 1);
                    even = fold_512(widen_lo(c2), widen_hi(c2), sh + 4, _mm512_loadu_ps(w + 64), _mm512_loadu_ps(w + 80), even, 1);
                    odd = fold_512(widen_lo(c3), widen_hi(c3), sh + 6, _mm512_loadu_ps(w + 96), _mm512_loadu_ps(w + 112), odd, 1);
                }
            }
        }
    } else { /* Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: blocks of 32; eight at a time, their scales widened together */
        const Py_ssize_t bytes = small_bytes(type), blocks = k / GROUP;
        Py_ssize_t g = 0;
        for (; g + 8 <= blocks; g += 8) {
            const uint8_t *b = raw + g * bytes;
            __m256 bv, sv = small_scales_512(type, b, bytes, &bv);
            _mm256_storeu_ps(s, sv);
            bacc = _mm256_fmadd_ps(bv, _mm256_loadu_ps(xs + g), bacc);
            for (int j = 0; j < 8; j += 2) {
                const float *w = x + (g + j) * GROUP;
                __m512 w0, w1, w2, w3;
                small_block_512(type, b + j * bytes, table, &w0, &w1);
                small_block_512(type, b + (j + 1) * bytes, table, &w2, &w3);
                even = fold_512(w0, w1, s + j, _mm512_loadu_ps(w), _mm512_loadu_ps(w + 16), even, 0);
                odd = fold_512(w2, w3, s + j + 1, _mm512_loadu_ps(w + 32), _mm512_loadu_ps(w + 48), odd, 0);
            }
        }
        gb = g;
        for (; g < blocks; g++) { /* the last blocks' biases are bias_dot's tail, one by one */
            const uint8_t *b = raw + g * bytes;
            float sc;
            small_scale(type, b, &sc, pending + np_++);
            __m512 w0, w1;
            small_block_512(type, b, table, &w0, &w1);
            const float *w = x + g * GROUP;
            if (g & 1)
                odd = fold_512(w0, w1, &sc, _mm512_loadu_ps(w), _mm512_loadu_ps(w + 16), odd, 0);
            else
                even = fold_512(w0, w1, &sc, _mm512_loadu_ps(w), _mm512_loadu_ps(w + 16), even, 0);
        }
    }
    float t = hsum(bacc);
    for (Py_ssize_t i = 0; i < np_; i++) t += pending[i] * xs[gb + i];
    return _mm512_reduce_add_ps(_mm512_add_ps(even, odd)) + t;
}

/* Q4_0, Q4_1, Q5_0 or Q5_1 rows against one activation row, R (1..WROWS) rows
 * of W at a time sharing each load of x, as wrows_512 does for the converted
 * 4-bit rows up to WIDE_ROW_BYTES: one at a time, short Q4_1 rows measured 1.25x
 * slower than converted (docs/performance.md, "All eight types as stored").
 * Each row's arithmetic is blocks_row_512's, step for step, so its bits are. */
AVX512 INLINE void small4_rows_512(const int type, const uint8_t *raw, Py_ssize_t raw_row, const float *x,
                                   const float *xs, float *out, Py_ssize_t k, const int R) {
    const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const Py_ssize_t bytes = small_bytes(type), blocks = k / GROUP;
    __m512 even[WROWS], odd[WROWS];
    __m256 bacc[WROWS];
    float s[WROWS][8], pending[WROWS][8];
    Py_ssize_t g = 0;
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) even[r] = odd[r] = _mm512_setzero_ps(), bacc[r] = _mm256_setzero_ps();
    for (; g + 8 <= blocks; g += 8) {
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            __m256 bv, sv = small_scales_512(type, raw + r * raw_row + g * bytes, bytes, &bv);
            _mm256_storeu_ps(s[r], sv);
            bacc[r] = _mm256_fmadd_ps(bv, _mm256_loadu_ps(xs + g), bacc[r]);
        }
        for (int j = 0; j < 8; j += 2) {
            const float *w = x + (g + j) * GROUP;
            __m512 x0 = _mm512_loadu_ps(w), x1 = _mm512_loadu_ps(w + 16), x2 = _mm512_loadu_ps(w + 32),
                   x3 = _mm512_loadu_ps(w + 48);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                const uint8_t *b = raw + r * raw_row + (g + j) * bytes;
                __m512 w0, w1, w2, w3;
                small_block_512(type, b, table, &w0, &w1);
                small_block_512(type, b + bytes, table, &w2, &w3);
                even[r] = fold_512(w0, w1, s[r] + j, x0, x1, even[r], 0);
                odd[r] = fold_512(w2, w3, s[r] + j + 1, x2, x3, odd[r], 0);
            }
        }
    }
    const Py_ssize_t gb = g;
    for (; g < blocks; g++) { /* the last blocks' biases are bias_dot's tail, one by one */
        const float *w = x + g * GROUP;
        __m512 x0 = _mm512_loadu_ps(w), x1 = _mm512_loadu_ps(w + 16);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const uint8_t *b = raw + r * raw_row + g * bytes;
            float sc;
            __m512 w0, w1;
            small_scale(type, b, &sc, pending[r] + (g - gb));
            small_block_512(type, b, table, &w0, &w1);
            if (g & 1)
                odd[r] = fold_512(w0, w1, &sc, x0, x1, odd[r], 0);
            else
                even[r] = fold_512(w0, w1, &sc, x0, x1, even[r], 0);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        float t = hsum(bacc[r]);
        for (Py_ssize_t i = 0; i < g - gb; i++) t += pending[r][i] * xs[gb + i];
        out[r] = _mm512_reduce_add_ps(_mm512_add_ps(even[r], odd[r])) + t;
    }
}

/* A 32-value block against x's 32 columns, one_row's sum: the 4- and 8-bit codes
 * widened from the block's bytes (nib32_at, dot32_at), Q5's assembled first
 * (small_codes) and widened from where they are stored, as Q5_K's and Q6_K's below. */
AVX2 INLINE __m256 small_dot(const int type, const uint8_t *b, const float *w) {
    if (type == GGML_Q4_0 || type == GGML_Q4_1) return nib32_at(b + (type == GGML_Q4_0 ? 2 : 4), w);
    if (type == GGML_Q8_0) return dot32_at(b + 2, w, NULL, 1);
    uint8_t codes[GROUP] __attribute__((aligned(32)));
    _mm256_store_si256((__m256i *)codes, small_codes(type, b));
    __asm__ volatile("" : : "r"(codes) : "memory"); /* widened from memory: see the K types' below */
    return dot32_at(codes, w, NULL, 0);
}

/* Block q (32 one-byte codes at c) of a Q5_K or Q6_K super-block into acc:
 * Q5_K one scale a block (one_row's 8-bit step), Q6_K two (g16_at's). */
AVX2 INLINE __m256 k_block_at(const int type, const uint8_t *c, const float *w, const float *s, int q, __m256 acc) {
    if (type != GGML_Q6_K) return _mm256_fmadd_ps(_mm256_broadcast_ss(s + q), dot32_at(c, w, NULL, 0), acc);
    __m256 u, t = dot32_at(c, w, &u, 0);
    return _mm256_fmadd_ps(_mm256_broadcast_ss(s + 2 * q + 1), u, _mm256_fmadd_ps(_mm256_broadcast_ss(s + 2 * q), t, acc));
}

/* One row of blocks against one activation row on AVX2, decoded as it is read
 * (no tile buffer): one_row's arithmetic (nib32_at / dot32_at / g16_at per block
 * of 32 columns, scaled into the even or odd accumulator, then bias_dot's sum) on
 * the same codes and scales, so the bits are one_row's. */
AVX2 INLINE float blocks_row_avx2(const int type, const uint8_t *raw, const float *x, const float *xs, Py_ssize_t k,
                                  Py_ssize_t pf) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), bacc = _mm256_setzero_ps();
    float s[16], bi[16];
    if (type != GGML_Q4_K && type != GGML_Q5_K && type != GGML_Q6_K) { /* one_row's blocks of 32, dot32_at's sum each */
        const Py_ssize_t bytes = small_bytes(type), blocks = k / GROUP;
        Py_ssize_t g = 0;
        for (; g + 8 <= blocks; g += 8) {
            const uint8_t *b = raw + g * bytes;
            __m256 bv, sv = small_scales(type, b, bytes, &bv);
            _mm256_storeu_ps(s, sv);
            bacc = _mm256_fmadd_ps(bv, _mm256_loadu_ps(xs + g), bacc);
            for (int j = 0; j < 8; j += 2) {
                const float *w = x + (g + j) * GROUP;
                a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(s + j), small_dot(type, b + j * bytes, w), a0);
                a1 = _mm256_fmadd_ps(_mm256_broadcast_ss(s + j + 1), small_dot(type, b + (j + 1) * bytes, w + 32), a1);
            }
        }
        const Py_ssize_t from = g;
        for (; g < blocks; g++) { /* one_row's last blocks (into a0, as even ones), bias_dot's tail */
            const uint8_t *b = raw + g * bytes;
            small_scale(type, b, s + (g - from), bi + (g - from));
            __m256 d = small_dot(type, b, x + g * GROUP);
            if ((g - from) & 1)
                a1 = _mm256_fmadd_ps(_mm256_broadcast_ss(s + (g - from)), d, a1);
            else
                a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(s + (g - from)), d, a0);
        }
        float tail = hsum(bacc);
        for (Py_ssize_t i = 0; i < blocks - from; i++) tail += bi[i] * xs[from + i];
        return hsum(_mm256_add_ps(a0, a1)) + tail;
    }
    const Py_ssize_t bytes = type == GGML_Q4_K ? 144 : type == GGML_Q5_K ? 176 : 210, per = type == GGML_Q6_K ? 16 : 8;
    for (Py_ssize_t j = 0; j < k / QK_K; j++) {
        const uint8_t *b = raw + j * bytes;
        if (pf) ahead_of(b + pf, bytes);
        const float *v = x + j * QK_K;
        decode_scales_avx2(type, b, s, bi);
        bacc = _mm256_fmadd_ps(_mm256_loadu_ps(bi), _mm256_loadu_ps(xs + j * per), bacc);
        if (per == 16) bacc = _mm256_fmadd_ps(_mm256_loadu_ps(bi + 8), _mm256_loadu_ps(xs + j * per + 8), bacc);
        if (type == GGML_Q4_K) {
            const __m256i m4 = _mm256_set1_epi32(15);
            for (int i = 0; i < 4; i++) { /* chunk i: group 2i the low nibbles, 2i + 1 the high ones */
                const uint8_t *q = b + 16 + 32 * i;
                const float *w = v + 64 * i;
                __m256 t = _mm256_setzero_ps(), u = t;
                for (int e = 0; e < 4; e++) { /* bytes 8e..8e+7: columns 8e.. of both groups */
                    const __m256i c = bytes8_at(q + 8 * e);
                    const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(c, m4));
                    const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(c, 4));
                    t = e ? _mm256_fmadd_ps(lo, _mm256_loadu_ps(w + 8 * e), t) : _mm256_mul_ps(lo, _mm256_loadu_ps(w));
                    u = e ? _mm256_fmadd_ps(hi, _mm256_loadu_ps(w + 32 + 8 * e), u) : _mm256_mul_ps(hi, _mm256_loadu_ps(w + 32));
                }
                a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(s + 2 * i), t, a0);
                a1 = _mm256_fmadd_ps(_mm256_broadcast_ss(s + 2 * i + 1), u, a1);
            }
        } else { /* Q5_K, Q6_K: the super-block's codes a byte each (decode_codes_avx2), then widened from there */
            uint8_t codes[QK_K] __attribute__((aligned(32)));
            decode_codes_avx2(type, b, codes);
            /* Widened from memory, not from the registers they were made in: left to itself gcc keeps them there
             * and extracts and shifts each 8 bytes (vpsrldq, vmovq) before widening them, 1.2x slower. */
            __asm__ volatile("" : : "r"(codes) : "memory");
            for (int q = 0; q < QK_K / GROUP; q += 2) { /* blocks q (even) and q + 1 (odd) */
                a0 = k_block_at(type, codes + GROUP * q, v + GROUP * q, s, q, a0);
                a1 = k_block_at(type, codes + GROUP * (q + 1), v + GROUP * (q + 1), s, q + 1, a1);
            }
        }
    }
    return hsum(_mm256_add_ps(a0, a1)) + hsum(bacc);
}

#define BLOCK_ROW_CASES(fn) \
    switch (type) { \
    case GGML_Q4_K: v = fn(GGML_Q4_K, row, xi, xsi, k, pf); break; \
    case GGML_Q5_K: v = fn(GGML_Q5_K, row, xi, xsi, k, pf); break; \
    case GGML_Q6_K: v = fn(GGML_Q6_K, row, xi, xsi, k, pf); break; \
    case GGML_Q5_0: v = fn(GGML_Q5_0, row, xi, xsi, k, pf); break; \
    case GGML_Q5_1: v = fn(GGML_Q5_1, row, xi, xsi, k, pf); break; \
    case GGML_Q4_0: v = fn(GGML_Q4_0, row, xi, xsi, k, pf); break; \
    case GGML_Q4_1: v = fn(GGML_Q4_1, row, xi, xsi, k, pf); break; \
    default: v = fn(GGML_Q8_0, row, xi, xsi, k, pf); break; \
    }

/* Rows [r0, r1) of block-form W against m activation rows (x [m, k], their
 * group sums xs `groups` apart, y [m, n]), a row of W and of x at a time: each
 * row's sums are those it gets alone, and a weight row stays in L1 for the m
 * rows that read it. The blocks are asked for PREFETCH bytes ahead (up to
 * `left` bytes past raw). wide: the AVX-512 kernel, else AVX2's. */
AVX512 void blocks_rows_512(int type, const uint8_t *raw, Py_ssize_t raw_row, Py_ssize_t r0, Py_ssize_t r1,
                            Py_ssize_t left, const float *x, const float *xs, float *y, Py_ssize_t m,
                            Py_ssize_t k, Py_ssize_t n, Py_ssize_t groups) {
    if (m == 1 && type != GGML_Q8_0 && type != GGML_Q4_K && type != GGML_Q5_K && type != GGML_Q6_K &&
        k / 2 <= WIDE_ROW_BYTES) {
        for (Py_ssize_t r = r0; r < r1; r += WROWS) {
            const int R = r1 - r < WROWS ? (int)(r1 - r) : WROWS;
            const char *at = (const char *)raw + r * raw_row;
            for (Py_ssize_t b = 0; b < R * raw_row && r * raw_row + PREFETCH + b < left; b += 64)
                __builtin_prefetch(at + PREFETCH + b, 0, PREFETCH_LOCALITY);
            const uint8_t *c = raw + r * raw_row;
#define SMALL4(T) \
            switch (R) { \
            case 1: small4_rows_512(T, c, raw_row, x, xs, y + r, k, 1); break; \
            case 2: small4_rows_512(T, c, raw_row, x, xs, y + r, k, 2); break; \
            case 3: small4_rows_512(T, c, raw_row, x, xs, y + r, k, 3); break; \
            default: small4_rows_512(T, c, raw_row, x, xs, y + r, k, WROWS); break; \
            }
            switch (type) {
            case GGML_Q4_0: SMALL4(GGML_Q4_0) break;
            case GGML_Q4_1: SMALL4(GGML_Q4_1) break;
            case GGML_Q5_0: SMALL4(GGML_Q5_0) break;
            default: SMALL4(GGML_Q5_1) break;
            }
#undef SMALL4
        }
        return;
    }
    /* A long row of a K type (a 1B model's down projection) is asked for a super-block at a time as it is read,
     * the same block of a row at least PREFETCH bytes on; a short one all at once (ahead_of). */
    const int spread = raw_row > LONG_ROW && (type == GGML_Q4_K || type == GGML_Q5_K || type == GGML_Q6_K);
    const Py_ssize_t ahead = (PREFETCH + raw_row - 1) / raw_row * raw_row;
    for (Py_ssize_t r = r0; r < r1; r++) {
        const char *at = (const char *)raw + r * raw_row;
        const Py_ssize_t pf = spread && (r + 1) * raw_row + ahead <= left ? ahead : 0;
        for (Py_ssize_t b = 0; !spread && b < raw_row && r * raw_row + PREFETCH + b < left; b += 64)
            __builtin_prefetch(at + PREFETCH + b, 0, PREFETCH_LOCALITY);
        const uint8_t *row = raw + r * raw_row;
        for (Py_ssize_t i = 0; i < m; i++) {
            const float *xi = x + i * k, *xsi = xs + i * groups;
            float v;
            BLOCK_ROW_CASES(blocks_row_512)
            y[i * n + r] = v;
        }
    }
}

AVX2 void blocks_rows_avx2(int type, const uint8_t *raw, Py_ssize_t raw_row, Py_ssize_t r0, Py_ssize_t r1,
                           Py_ssize_t left, const float *x, const float *xs, float *y, Py_ssize_t m,
                           Py_ssize_t k, Py_ssize_t n, Py_ssize_t groups) {
    const int spread = raw_row > LONG_ROW && (type == GGML_Q4_K || type == GGML_Q5_K || type == GGML_Q6_K);
    const Py_ssize_t ahead = (PREFETCH + raw_row - 1) / raw_row * raw_row;
    for (Py_ssize_t r = r0; r < r1; r++) {
        const char *at = (const char *)raw + r * raw_row;
        const Py_ssize_t pf = spread && (r + 1) * raw_row + ahead <= left ? ahead : 0;
        for (Py_ssize_t b = 0; !spread && b < raw_row && r * raw_row + PREFETCH + b < left; b += 64)
            __builtin_prefetch(at + PREFETCH + b, 0, PREFETCH_LOCALITY);
        const uint8_t *row = raw + r * raw_row;
        for (Py_ssize_t i = 0; i < m; i++) {
            const float *xi = x + i * k, *xsi = xs + i * groups;
            float v;
            BLOCK_ROW_CASES(blocks_row_avx2)
            y[i * n + r] = v;
        }
    }
}
#endif
