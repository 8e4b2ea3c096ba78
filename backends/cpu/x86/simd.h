/* The x86 helpers more than one x86 file inlines (ggml keeps the like in
 * simd-mappings.h): static inline, so every kernel that calls them keeps them
 * inlined as it did in one file. Only the files under x86/ include this.
 * hsum and half_sum are always_inline (INLINE): as plain static inline gcc
 * called them out of line from 196 and 166 places, once per output row of
 * the one-row kernels, 3.3% of Gemma 3's q8 decode samples (a call and a
 * return around five instructions); the instructions, and so the bits, are the same. */

#ifndef INFER_CPU_SIMD_H
#define INFER_CPU_SIMD_H

#include "../kernels.h"

#ifdef HAVE_X86

AVX2 INLINE float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* A 16-lane accumulator's halves added (lanes l + l+8): with hsum, q8's fold of
 * its sixteen lanes (q8.c's q8_fold), on every x86 path. */
AVX512 INLINE __m256 half_sum(__m512 a) {
    return _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
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

/* Q5_0/Q5_1's codes: the 32 fifth bits spread to bytes (byte j of the broadcast
 * word picked by j / 8, its bit j % 8 tested), as 16, or'd onto the nibbles. */
AVX2 INLINE __m256i q5_vector(const uint8_t *qh4, const uint8_t *qs) {
    uint32_t qh;
    memcpy(&qh, qh4, 4);
    const __m256i pick = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
    __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), pick);
    __m256i fifth = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
    __m128i q = _mm_loadu_si128((const __m128i *)qs), m4 = _mm_set1_epi8(15);
    __m256i nib = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m4), _mm_and_si128(q, m4));
    return _mm256_or_si256(nib, fifth);
}

/* The 32-value types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): bytes a block, a block's
 * 32 codes a byte each in column order (a 4-bit block's low nibbles are its
 * columns 0..15, the high ones 16..31: as floats, the values the 4-bit
 * kernels' table gives), and the scales and biases of 8 consecutive blocks
 * (decode_scales' values: float16 widened, a symmetric bias its factor times
 * the scale). */
/* small_bytes and small_factor are always_inline: as plain static inline (no target of their own) gcc kept
 * small_factor out of line, a call from every span of the one-row q8 kernels on Q8_0 (Gemma 3's head): 11.6%
 * of its q8 decode samples on an AMD EPYC (Zen 3), AVX2. */
INLINE Py_ssize_t small_bytes(int type) {
    return type == GGML_Q4_0 ? 18 : type == GGML_Q4_1 ? 20 : type == GGML_Q5_0 ? 22 : type == GGML_Q5_1 ? 24 : 34;
}
/* A symmetric 32-value type's bias over its scale (Q4_0, Q5_0, Q8_0: decode_scales' factors). */
INLINE float small_factor(int type) { return type == GGML_Q4_0 ? -8.0f : type == GGML_Q5_0 ? -16.0f : -128.0f; }

/* blocks.c's decode_scales for one 32-value block with F16C (exact, as half_to_float is). */
AVX2 INLINE void small_scale(int type, const uint8_t *b, float *s, float *bi) {
    uint16_t d, m;
    memcpy(&d, b, 2);
    s[0] = _cvtsh_ss(d);
    if (type == GGML_Q4_1 || type == GGML_Q5_1) {
        memcpy(&m, b + 2, 2);
        bi[0] = _cvtsh_ss(m);
    } else {
        bi[0] = small_factor(type) * s[0];
    }
}

/* blocks.c's decode_scales for a K type's block in registers: s0, b0 its groups 0..7's scales and biases,
 * s1, b1 (Q6_K) 8..15's (the same float32 products). */
AVX2 INLINE void k_scales(const int type, const uint8_t *b, __m256 *s0, __m256 *s1, __m256 *b0, __m256 *b1) {
    if (type == GGML_Q4_K || type == GGML_Q5_K) {
        /* k_sixbits in one register: the block's first 16 bytes as words [d|dmin, u0, u1, u2];
         * lanes [u0, u2, u1, u2] and [u0, u0, u1, u1] give sc 0..3, sc 4..7, m 0..3, m 4..7. */
        __m128i q = _mm_loadu_si128((const __m128i *)b);
        __m128i p = _mm_shuffle_epi32(q, _MM_SHUFFLE(3, 2, 3, 1)), r = _mm_shuffle_epi32(q, _MM_SHUFFLE(2, 2, 1, 1));
        __m128i lo = _mm_and_si128(r, _mm_set1_epi8(0x3f));
        __m128i hi = _mm_or_si128(_mm_and_si128(_mm_srlv_epi32(p, _mm_setr_epi32(0, 0, 0, 4)), _mm_set1_epi8(0x0f)),
                                  _mm_and_si128(_mm_srli_epi32(r, 2), _mm_set1_epi8(0x30)));
        __m128i six = _mm_blend_epi32(lo, hi, 0xA);
        __m128 dd = _mm_cvtph_ps(q); /* d, dmin */
        const __m256 d = _mm256_broadcastss_ps(dd), dmin = _mm256_broadcastss_ps(_mm_movehdup_ps(dd));
        __m256 fs = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(six));
        __m256 fm = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(six, 8)));
        *s0 = _mm256_mul_ps(d, fs);
        *b0 = _mm256_xor_ps(_mm256_mul_ps(dmin, fm), _mm256_set1_ps(-0.0f)); /* -(dmin * m) */
    } else { /* Q6_K */
        const __m256 d = _mm256_set1_ps(_cvtsh_ss((uint16_t)(b[208] | b[209] << 8))), f = _mm256_set1_ps(-32.0f);
        __m128i sc = _mm_loadu_si128((const __m128i *)(b + 192));
        *s0 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
        *s1 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))));
        *b0 = _mm256_mul_ps(f, *s0);
        *b1 = _mm256_mul_ps(f, *s1);
    }
}

/* blocks.c's decode_scales, eight at a time where a block has 8 or 16 groups (the same float32 products). */
AVX2 INLINE void decode_scales_avx2(int type, const uint8_t *b, float *s, float *bi) {
    if (type == GGML_Q4_K || type == GGML_Q5_K || type == GGML_Q6_K) {
        __m256 s0, s1, b0, b1;
        k_scales(type, b, &s0, &s1, &b0, &b1);
        _mm256_storeu_ps(s, s0);
        _mm256_storeu_ps(bi, b0);
        if (type == GGML_Q6_K) {
            _mm256_storeu_ps(s + 8, s1);
            _mm256_storeu_ps(bi + 8, b1);
        }
    } else {
        small_scale(type, b, s, bi); /* one float16 (or two) per block */
    }
}

AVX2 INLINE __m256i small_codes(int type, const uint8_t *b) {
    if (type == GGML_Q8_0) /* int8 q -> q + 128 */
        return _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(b + 2)), _mm256_set1_epi8((char)0x80));
    if (type == GGML_Q4_0 || type == GGML_Q4_1) {
        const __m128i q = _mm_loadu_si128((const __m128i *)(b + (type == GGML_Q4_0 ? 2 : 4))), m4 = _mm_set1_epi8(15);
        return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m4), _mm_and_si128(q, m4));
    }
    return type == GGML_Q5_0 ? q5_vector(b + 2, b + 6) : q5_vector(b + 4, b + 8);
}

/* The exact one-row kernels' codes as floats on AVX2, widened straight from
 * memory. On the AVX2 CPU measured (Zen 3) vcvtdq2ps issues two a cycle, on the
 * two pipes that add, and a vpmovzxbd from memory two a cycle, where one from a
 * register (after an extract or byte shift) crosses lanes at about one in 1.3
 * cycles; one widening gives a byte's two nibbles (an and, a shift)
 * (docs/performance.md, "The exact products on AVX2" and "The exact products'
 * bound, measured again"). The values, and the order of the sums, are the
 * register forms': the same bits. */
AVX2 INLINE __m256i bytes8_at(const uint8_t *p) { /* 8 bytes as 8 integer lanes */
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
}

/* 32 one-byte codes in column order (c) as four vectors of 8 floats, columns 0..7,
 * 8..15, 16..23, 24..31. `flip` xors each code with 0x80 (Q8_0's int8 q as the
 * code q + 128). */
AVX2 INLINE void codes32_at(const uint8_t *c, __m256 *w, const int flip) {
    const __m256i f = _mm256_set1_epi32(flip ? 0x80 : 0);
    for (int j = 0; j < 4; j++)
        w[j] = _mm256_cvtepi32_ps(flip ? _mm256_xor_si256(bytes8_at(c + 8 * j), f) : bytes8_at(c + 8 * j));
}

/* A block of 32 4-bit codes in GGML's order (16 bytes: byte j holds column j in
 * its low nibble, j + 16 in its high one) as codes32_at's four vectors: columns
 * 0..7 and 16..23 come from one widening of bytes 0..7. */
AVX2 INLINE void nibbles32_at(const uint8_t *c, __m256 *w) {
    const __m256i m4 = _mm256_set1_epi32(15);
    const __m256i c0 = bytes8_at(c), c1 = bytes8_at(c + 8);
    w[0] = _mm256_cvtepi32_ps(_mm256_and_si256(c0, m4)), w[1] = _mm256_cvtepi32_ps(_mm256_and_si256(c1, m4));
    w[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(c0, 4)), w[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(c1, 4));
}

/* A block's four vectors (w) against x's 32 columns (v): t = columns 0..7, then
 * 8..15, 16..23, 24..31 multiplied in; or, with u, t of 0..15 and *u of 16..31
 * (a scale per 16 columns). */
AVX2 INLINE __m256 dot32_of(const __m256 *w, const float *v, __m256 *u) {
    __m256 t = _mm256_mul_ps(w[0], _mm256_loadu_ps(v));
    t = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(v + 8), t);
    if (u) {
        *u = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(v + 24), _mm256_mul_ps(w[2], _mm256_loadu_ps(v + 16)));
        return t;
    }
    t = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(v + 16), t);
    return _mm256_fmadd_ps(w[3], _mm256_loadu_ps(v + 24), t);
}

/* 32 one-byte codes (codes32_at) against x's 32 columns: dot32_of's sums. */
AVX2 INLINE __m256 dot32_at(const uint8_t *c, const float *v, __m256 *u, const int flip) {
    __m256 w[4];
    codes32_at(c, w, flip);
    return dot32_of(w, v, u);
}

/* A block of 32 4-bit codes (nibbles32_at) against x's 32 columns: dot32_of's sum. */
AVX2 INLINE __m256 nib32_at(const uint8_t *c, const float *v) {
    __m256 w[4];
    nibbles32_at(c, w);
    return dot32_of(w, v, NULL);
}

AVX2 INLINE __m256 small_scales(int type, const uint8_t *b, Py_ssize_t bytes, __m256 *biases) {
    /* The eight blocks' float16 words inserted one by one into a register: a
     * gather measured slower (AMD Zen 4), and eight two-byte stores read back as
     * one vector stall on store forwarding (docs/performance.md, "All eight types
     * as stored"). */
    const int pair = type == GGML_Q4_1 || type == GGML_Q5_1;
    uint16_t h;
    __m128i d = _mm_setzero_si128(), m = _mm_setzero_si128();
#define SMALL_WORD(J) \
    memcpy(&h, b + (J) * bytes, 2), d = _mm_insert_epi16(d, h, J); \
    if (pair) memcpy(&h, b + (J) * bytes + 2, 2), m = _mm_insert_epi16(m, h, J);
    SMALL_WORD(0) SMALL_WORD(1) SMALL_WORD(2) SMALL_WORD(3) SMALL_WORD(4) SMALL_WORD(5) SMALL_WORD(6) SMALL_WORD(7)
#undef SMALL_WORD
    __m256 sv = _mm256_cvtph_ps(d);
    *biases = pair ? _mm256_cvtph_ps(m) : _mm256_mul_ps(_mm256_set1_ps(small_factor(type)), sv);
    return sv;
}

/* small_scales with AVX512-BW, without a gather: the eight blocks' float16
 * words picked out of their bytes (two loads and a masked third, which reads
 * nothing past the eighth block's scales) by two word permutes. The gather's
 * loads cost more than the rest of a block's decoding here (AMD Zen 4: Q4_1
 * rows 1.36x the converted form's time with it, 0.81x with the scales
 * replaced by constants; docs/performance.md, "All eight types as stored").
 * The same float32 values. Not Q8_0, whose 34-byte blocks span four lines. */
AVX512 INLINE __m256 small_scales_512(int type, const uint8_t *b, Py_ssize_t bytes, __m256 *biases) {
    if (type == GGML_Q8_0) return small_scales(type, b, bytes, biases);
    const int pair = type == GGML_Q4_1 || type == GGML_Q5_1; /* d and m */
    const Py_ssize_t half = bytes / 2, need = 7 * bytes + (pair ? 4 : 2);  /* words a block; bytes read */
    /* lanes 0..7: d_j, the word j * half; lanes 8..15: m_j, the next one (or d_j again) */
    const __m512i j = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7);
    __m512i idx32 = _mm512_add_epi32(_mm512_mullo_epi32(j, _mm512_set1_epi32((int)half)),
                                     _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, pair, pair, pair, pair, pair, pair, pair, pair));
    const __m256i idx = _mm512_cvtepi32_epi16(idx32); /* 16 word indices, all < 96 */
    const __m512i a = _mm512_loadu_si512((const void *)b), c = _mm512_loadu_si512((const void *)(b + 64));
    const __m512i e = _mm512_maskz_loadu_epi8(need > 128 ? (__mmask64)(~0ULL >> (64 - (need - 128))) : 0, b + 128);
    const __m512i wide = _mm512_castsi256_si512(idx);
    const __m512i lo = _mm512_permutex2var_epi16(a, wide, c);
    const __m512i hi = _mm512_permutexvar_epi16(_mm512_sub_epi16(wide, _mm512_set1_epi16(64)), e);
    const __mmask32 past = _mm512_cmpge_epu16_mask(wide, _mm512_set1_epi16(64));
    const __m256i dm = _mm512_castsi512_si256(_mm512_mask_blend_epi16(past, lo, hi));
    __m256 sv = _mm256_cvtph_ps(_mm256_castsi256_si128(dm));
    *biases = pair ? _mm256_cvtph_ps(_mm256_extracti128_si256(dm, 1))
                   : _mm256_mul_ps(_mm256_set1_ps(small_factor(type)), sv);
    return sv;
}

#ifndef LONG_ROW
#define LONG_ROW 2048
#endif
/* Long rows (over LONG_ROW bytes: a 1B model's down projection, 8192 columns), in the q8 and exact one-row kernels,
 * are read a row a step, each span's bytes asked for as it is read, pf bytes
 * ahead (the same span of a row at least PREFETCH bytes on). Asked for all at
 * once, two such rows a step as the short ones are, 144 prefetches queued in a
 * burst ahead of the products, and the rows were read at two thirds of the
 * short rows' speed; spread out, short rows went slower instead. */
INLINE void ahead_of(const uint8_t *at, Py_ssize_t bytes) {
    for (Py_ssize_t b = 0; b < bytes; b += 64) __builtin_prefetch(at + b, 0, PREFETCH_LOCALITY);
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
