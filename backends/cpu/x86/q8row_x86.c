/* q8.c's one-row products (decoding with activations="q8") on x86: the blocks
 * as a GGUF file stores them against one activation row rounded to int8 in
 * column order, with no tile decoded, packed or interleaved first.
 *
 * The sums are q8.c's, lane for lane: a span of sixteen groups gives sixteen
 * integer sums, lane l the sum of group l's codes times its rounded values,
 * and the lanes take (float)isum * (scale * dx), then bias * xsum, in two
 * fused multiply-adds, as q8_tile_vnni and q8_tile_avx2 do; the sixteen lanes
 * are folded l + l+8, then +4, +2, +1. Integer sums are exact in any order, so
 * a row here has the bits the tile kernels (and the portable loops) give it
 * (tests/test_activations_q8.py).
 *
 * What differs is where a group's sum comes from. The tile kernels interleave
 * sixteen groups so that one vpdpbusd lane holds one group; here 32 codes of a
 * group (or two groups of 16) fill 32 bytes in column order, as the blocks
 * hold them, so vpdpbusd leaves a group's sum spread over eight lanes (four
 * for groups of 16), and a span's eight products are reduced to sixteen lanes
 * (span_sums). On AVX2, vpmaddubsw and vpmaddwd give the
 * same eight-lane sums and vphaddd reduces them. The codes come from the block
 * in registers: the nibbles masked and shifted, Q5's fifth bits or'ed in,
 * Q6_K's two high bits placed, Q8_0's signed bytes offset by 128 (AVX2 keeps
 * them signed and adds 128 * sum(q), as its tile kernel does). */

#include "simd.h"

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-wrapv") /* as in q8_x86.c: nothing here relies on signed overflow wrapping */
#endif

#ifdef HAVE_X86
/* The loops over a step's rows and AVX2's span vectors, unrolled. The VNNI loop over a span's vectors is
 * written out instead (PAIR below): gcc 12 kept it a loop despite this pragma, the products in an array on
 * the stack, and a Q4_1 row ran at half the exact kernel's speed. */
#define UNROLL _Pragma("GCC unroll 16")

/* A type's layout for these loops: values and bytes a block, groups a block, and 32-byte code vectors a block. */
#define KTYPE(t) ((t) == GGML_Q4_K || (t) == GGML_Q5_K || (t) == GGML_Q6_K)
#define VALUES(t) (KTYPE(t) ? QK_K : 32)
#define GROUPS(t) ((t) == GGML_Q6_K ? 16 : KTYPE(t) ? 8 : 1)
#define VECTORS(t) (KTYPE(t) ? 8 : 1)
#define BYTES(t) ((t) == GGML_Q4_K ? 144 : (t) == GGML_Q5_K ? 176 : (t) == GGML_Q6_K ? 210 : small_bytes(t))

/* Code vector i (32 consecutive columns, i < VECTORS) of block b as unsigned bytes in column order;
 * signed: Q8_0's bytes as stored (q - 128 of the unsigned code), for AVX2's sign trick. */
AVX2 INLINE __m256i code_vector(const int type, const uint8_t *b, const int i, const int signed_q8) {
    const __m256i m4 = _mm256_set1_epi8(15);
    switch (type) {
    case GGML_Q4_0: case GGML_Q4_1: case GGML_Q5_0: case GGML_Q5_1: return small_codes(type, b);
    case GGML_Q8_0: return signed_q8 ? _mm256_loadu_si256((const __m256i *)(b + 2)) : small_codes(type, b);
    case GGML_Q4_K: { /* 32 bytes: group 2c in the low nibbles, 2c + 1 in the high */
        const __m256i v = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * (i / 2)));
        return _mm256_and_si256(i & 1 ? _mm256_srli_epi16(v, 4) : v, m4);
    }
    case GGML_Q5_K: { /* and bit i of each qh byte as 16 */
        const __m256i v = _mm256_loadu_si256((const __m256i *)(b + 48 + 32 * (i / 2)));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16));
        const __m256i fifth = _mm256_and_si256(_mm256_srli_epi16(qh, i), _mm256_set1_epi8(1));
        return _mm256_or_si256(_mm256_and_si256(i & 1 ? _mm256_srli_epi16(v, 4) : v, m4), _mm256_slli_epi16(fifth, 4));
    }
    default: { /* Q6_K: half h = i / 4, columns 128h + 32t for t = i % 4 */
        const int h = i / 4, t = i % 4;
        const __m256i m30 = _mm256_set1_epi8(0x30);
        const __m256i l = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32 * (t & 1)));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
        const __m256i low = _mm256_and_si256(t >= 2 ? _mm256_srli_epi16(l, 4) : l, m4);
        const __m256i high = t == 0 ? _mm256_slli_epi16(qh, 4) : t == 1 ? _mm256_slli_epi16(qh, 2)
                           : t == 2 ? qh : _mm256_srli_epi16(qh, 2);
        return _mm256_or_si256(low, _mm256_and_si256(high, m30));
    }
    }
}

/* Code vector u of a span (0..15, or 0..7 for Q6_K), whose first block is raw's block j0; zeros past the row. */
AVX2 INLINE __m256i span_vector(const int type, const uint8_t *raw, Py_ssize_t j0, Py_ssize_t blocks, const int u,
                                const int signed_q8) {
    const Py_ssize_t j = j0 + u / VECTORS(type);
    return j < blocks ? code_vector(type, raw + j * BYTES(type), u % VECTORS(type), signed_q8) : _mm256_setzero_si256();
}

/* small_scales for the row's last c (1..7) blocks, zeros after them: the words
 * inserted one by one (stored to the stack and read back as a vector, they
 * stalled on store forwarding once a row, a quarter of a short row's time). */
AVX2 INLINE __m256 part_scales(const int type, const uint8_t *b, const int c, __m256 *biases) {
    const int pair = type == GGML_Q4_1 || type == GGML_Q5_1;
    const Py_ssize_t bytes = BYTES(type);
    __m128i d = _mm_setzero_si128(), m = _mm_setzero_si128();
    uint16_t w;
    switch (c) { /* each case falls through to the blocks before it */
#define WORD(J) \
    case J + 1: memcpy(&w, b + J * bytes, 2), d = _mm_insert_epi16(d, w, J); \
        if (pair) memcpy(&w, b + J * bytes + 2, 2), m = _mm_insert_epi16(m, w, J); /* fall through */
    WORD(6) WORD(5) WORD(4) WORD(3) WORD(2) WORD(1) WORD(0)
#undef WORD
    default: break;
    }
    const __m256 sv = _mm256_cvtph_ps(d);
    /* the symmetric types' factor * 0 is -0: the lanes past the row keep +0, as every path has them */
    const __m256 live = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(c), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
    *biases = pair ? _mm256_cvtph_ps(m) : _mm256_and_ps(live, _mm256_mul_ps(_mm256_set1_ps(small_factor(type)), sv));
    return sv;
}

/* A span's sixteen scales and biases (decode_scales' values) in registers, groups 0..7 in s[0] and b[0],
 * 8..15 in s[1] and b[1]; zeros past the row. Read back from the stack, as
 * decode_scales_avx2 leaves them, the two 32-byte stores under one 64-byte
 * load stalled on store forwarding: a quarter of the kernel's samples. Eight
 * small blocks' float16 words come from small_scales (small_scales_512 on
 * AVX-512, which picks them out with permutes). */
#define SPAN_SCALES(name, attr, eight)                                                                                \
    attr INLINE void name(const int type, const uint8_t *raw, Py_ssize_t j0, Py_ssize_t blocks, __m256 *s, __m256 *b) { \
        if (type == GGML_Q6_K) {                                                                                      \
            k_scales(type, raw + j0 * BYTES(type), &s[0], &s[1], &b[0], &b[1]);                                       \
            return;                                                                                                   \
        }                                                                                                             \
        UNROLL for (int h = 0; h < 2; h++) {                                                                          \
            s[h] = b[h] = _mm256_setzero_ps();                                                                        \
            if (KTYPE(type)) { /* a block of eight groups a half */                                                   \
                if (j0 + h < blocks) k_scales(type, raw + (j0 + h) * BYTES(type), &s[h], NULL, &b[h], NULL);          \
            } else if (j0 + 8 * h + 8 <= blocks) { /* eight blocks a half */                                          \
                s[h] = eight(type, raw + (j0 + 8 * h) * BYTES(type), BYTES(type), &b[h]);                             \
            } else if (j0 + 8 * h < blocks) { /* the row's last blocks */                                             \
                s[h] = part_scales(type, raw + (j0 + 8 * h) * BYTES(type), (int)(blocks - j0 - 8 * h), &b[h]);        \
            }                                                                                                         \
        }                                                                                                             \
    }
SPAN_SCALES(span_scales, AVX2, small_scales)
SPAN_SCALES(span_scales_512, AVX512, small_scales_512)
#undef SPAN_SCALES

/* Code vectors u and u + 1 of a span as one. Two blocks of 4- or 5-bit codes:
 * their 16 bytes of nibbles each loaded once, each placed twice and shifted by 0
 * or 4 a half (one 64-bit shift per element; the mask drops what crossed
 * bytes), and Q5's fifth bits set as 16 through a byte mask. */
AVX512 INLINE __m512i pair_vector(const int type, const uint8_t *raw, Py_ssize_t j0, Py_ssize_t blocks, const int u) {
    if (!KTYPE(type) && type != GGML_Q8_0 && j0 + u + 1 < blocks) {
        const Py_ssize_t off = type == GGML_Q4_0 ? 2 : type == GGML_Q4_1 ? 4 : type == GGML_Q5_0 ? 6 : 8;
        const uint8_t *b = raw + (j0 + u) * BYTES(type) + off;
        const __m256i two = _mm256_set_m128i(_mm_loadu_si128((const __m128i *)(b + BYTES(type))), _mm_loadu_si128((const __m128i *)b));
        const __m512i each = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 1, 0, 1, 2, 3, 2, 3), _mm512_castsi256_si512(two));
        const __m512i nibbles = _mm512_and_si512(_mm512_srlv_epi64(each, _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4)),
                                                 _mm512_set1_epi8(15));
        if (type == GGML_Q4_0 || type == GGML_Q4_1) return nibbles;
        /* Q5: bit i of a block's 32-bit qh is its column i's fifth bit; the two blocks' words are the byte mask of 16s */
        uint32_t h0, h1;
        memcpy(&h0, b - 4, 4);
        memcpy(&h1, b + BYTES(type) - 4, 4);
        return _mm512_or_si512(nibbles, _mm512_maskz_set1_epi8((__mmask64)h0 | (__mmask64)h1 << 32, 16));
    }
    return _mm512_inserti64x4(_mm512_castsi256_si512(span_vector(type, raw, j0, blocks, u, 0)),
                              span_vector(type, raw, j0, blocks, u + 1, 0), 1);
}

/* Two halves as one vector (a[0] in lanes 0..7). */
AVX512 INLINE __m512 join(const __m256 *a) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(a[0])), _mm256_castps_pd(a[1]), 1));
}

/* Per 128-bit lane, a's and b's four values summed in pairs: [a0 + a2, b0 + b2, a1 + a3, b1 + b3]. */
AVX512 INLINE __m512i sums32(__m512i a, __m512i b) {
    return _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
}
/* The next round: [c0 + c2, c1 + c3, d0 + d2, d1 + d3] of two sums32 results. */
AVX512 INLINE __m512i sums64(__m512i c, __m512i d) {
    return _mm512_add_epi32(_mm512_unpacklo_epi64(c, d), _mm512_unpackhi_epi64(c, d));
}

/* A span's products (p[i]: code vectors 2i and 2i + 1 against q) reduced to its sixteen groups' sums, group
 * l in lane l. Two rounds inside 128-bit lanes leave, per lane, each of four products' sum over that lane
 * (in-lane unpacks: 1-cycle instructions, where a cross-lane permute per round took most of the kernel's
 * time); a last shuffle of 128-bit lanes (groups of 32, which fill two of them) and one permute put the
 * groups in order. */
AVX512 INLINE __m512i span_sums(const __m512i *p, const int vectors) {
    if (vectors == 8) { /* groups of 16: lane 4j + i holds group 4i + j */
        const __m512i t = sums64(sums32(p[0], p[1]), sums32(p[2], p[3]));
        return _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), t);
    }
    const __m512i lo = sums64(sums32(p[0], p[1]), sums32(p[2], p[3])), hi = sums64(sums32(p[4], p[5]), sums32(p[6], p[7]));
    /* lanes of 128 bits: lo's 0 and 1 (2 and 3) are the first (second) group of p[0..3]; hi's of p[4..7] */
    const __m512i z = _mm512_add_epi32(_mm512_shuffle_i32x4(lo, hi, _MM_SHUFFLE(2, 0, 2, 0)),
                                       _mm512_shuffle_i32x4(lo, hi, _MM_SHUFFLE(3, 1, 3, 1)));
    /* z: groups 0 2 4 6, 1 3 5 7, 8 10 12 14, 9 11 13 15 */
    return _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15), z);
}

/* One span of R (1 or 2) rows (raw_row bytes apart) from block j0, against qs (the span's int8 values), dx
 * and xs (its sixteen groups'), into acc. `limit`: the row's block count, or j0 + the span's blocks for a
 * span known whole, in which every "past the row" test below folds away at compile time (a short row spent
 * more on those tests and their branches than on its products: Gemma 3's 640-column head). */
AVX512VNNI INLINE void q8_span_vnni(const int type, const int R, const uint8_t *raw, Py_ssize_t raw_row, Py_ssize_t pf,
                                    const int8_t *qs, const float *dx, const float *xs, Py_ssize_t j0, Py_ssize_t limit,
                                    const int vectors, __m512 *acc) {
    UNROLL for (int r = 0; r < R; r++) {
        const uint8_t *w = raw + r * raw_row;
        if (pf) ahead_of(w + j0 * BYTES(type) + pf, (16 / GROUPS(type)) * BYTES(type));
        __m512i p[8];
        /* a row's last span may hold fewer blocks: no work for the others */
#define PAIR(u) p[(u) / 2] = j0 + (u) / VECTORS(type) < limit                                                         \
                ? _mm512_dpbusd_epi32(_mm512_setzero_si512(), pair_vector(type, w, j0, limit, u),                      \
                                      _mm512_loadu_si512(qs + 32 * (u)))                                               \
                : _mm512_setzero_si512();
        PAIR(0) PAIR(2) PAIR(4) PAIR(6)
        if (vectors == 16) { PAIR(8) PAIR(10) PAIR(12) PAIR(14) }
#undef PAIR
        const __m512i isum = span_sums(p, vectors);
        __m256 sc[2], bi[2];
        span_scales_512(type, w, j0, limit, sc, bi);
        const __m512 t = _mm512_mul_ps(join(sc), _mm512_loadu_ps(dx));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), t, acc[r]);
        acc[r] = _mm512_fmadd_ps(join(bi), _mm512_loadu_ps(xs), acc[r]);
    }
}

/* R (1 or 2) rows of blocks, raw_row bytes apart, against q (k int8 values in column order, whole spans of
 * them), dx and xs (a lane per group; qsum, each group's sum of q, is AVX2's), into y[0..R). Two rows at a
 * time: a short row (SmolLM2's 576 columns, two spans) is otherwise a chain of dependent reductions with
 * little for the core to overlap; the two rows' chains interleave, and they share each load of q. The whole
 * spans first, then the row's last, partial one (the same lanes, so the same sums as one loop). */
AVX512VNNI INLINE void q8_row_vnni(const int type, const int R, const uint8_t *raw, Py_ssize_t raw_row, Py_ssize_t pf, const int8_t *q,
                                   const float *dx, const float *xs, const int32_t *qsum, Py_ssize_t k, float *y) {
    (void)qsum;
    const Py_ssize_t blocks = k / VALUES(type), per = 16 / GROUPS(type); /* blocks a span */
    const int vectors = type == GGML_Q6_K ? 8 : 16;                     /* code vectors a span */
    __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    Py_ssize_t s = 0, j0 = 0;
    for (; j0 + per <= blocks; s++, j0 += per)
        q8_span_vnni(type, R, raw, raw_row, pf, q + s * 32 * vectors, dx + s * 16, xs + s * 16, j0, j0 + per, vectors, acc);
    if (j0 < blocks)
        q8_span_vnni(type, R, raw, raw_row, pf, q + s * 32 * vectors, dx + s * 16, xs + s * 16, j0, blocks, vectors, acc);
    for (int r = 0; r < R; r++) y[r] = hsum(half_sum(acc[r])); /* lanes l + l+8, then +4, +2, +1 */
}

/* Eight groups' sums from eight vectors of eight lanes (one group each): the totals in order. */
AVX2 INLINE __m256i eight_sums(const __m256i *v) {
    const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

/* Eight groups of 16 from four vectors (two groups each, four lanes apiece): the totals in order. */
AVX2 INLINE __m256i eight_sums16(const __m256i *v) {
    const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    return _mm256_permutevar8x32_epi32(a, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* q8_row_vnni's sums on AVX2 (qsum: each lane's sum of q, for Q8_0's signed codes). */
AVX2 INLINE void q8_row_avx2(const int type, const int R, const uint8_t *raw, Py_ssize_t raw_row, Py_ssize_t pf, const int8_t *q,
                             const float *dx, const float *xs, const int32_t *qsum, Py_ssize_t k, float *y) {
    const Py_ssize_t blocks = k / VALUES(type), per = 16 / GROUPS(type);
    const int vectors = type == GGML_Q6_K ? 8 : 16, wide = type == GGML_Q8_0;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[2][2] = {{_mm256_setzero_ps(), _mm256_setzero_ps()}, {_mm256_setzero_ps(), _mm256_setzero_ps()}};
    for (Py_ssize_t s = 0, j0 = 0; j0 < blocks; s++, j0 += per)
      UNROLL for (int r = 0; r < R; r++) {
        const int8_t *qs = q + s * 32 * vectors;
        const uint8_t *w = raw + r * raw_row;
        if (pf) ahead_of(w + j0 * BYTES(type) + pf, per * BYTES(type));
        __m256i p[16], isum[2];
        UNROLL for (int u = 0; u < vectors; u++) {
            if (j0 + u / VECTORS(type) >= blocks) { /* past the row's last block */
                p[u] = _mm256_setzero_si256();
                continue;
            }
            const __m256i c = span_vector(type, w, j0, blocks, u, wide), x = _mm256_loadu_si256((const __m256i *)(qs + 32 * u));
            p[u] = _mm256_madd_epi16(wide ? _mm256_maddubs_epi16(_mm256_abs_epi8(c), _mm256_sign_epi8(x, c))
                                          : _mm256_maddubs_epi16(c, x), ones);
        }
        if (vectors == 16) {
            isum[0] = eight_sums(p), isum[1] = eight_sums(p + 8);
        } else {
            isum[0] = eight_sums16(p), isum[1] = eight_sums16(p + 4);
        }
        __m256 sc[2], bi[2];
        span_scales(type, w, j0, blocks, sc, bi);
        for (int h = 0; h < 2; h++) {
            const Py_ssize_t g = s * 16 + h * 8;
            __m256i is = isum[h];
            if (wide) is = _mm256_add_epi32(is, _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)(qsum + g)), 7));
            const __m256 t = _mm256_mul_ps(sc[h], _mm256_loadu_ps(dx + g));
            acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), t, acc[r][h]);
            acc[r][h] = _mm256_fmadd_ps(bi[h], _mm256_loadu_ps(xs + g), acc[r][h]);
        }
    }
    for (int r = 0; r < R; r++) y[r] = hsum(_mm256_add_ps(acc[r][0], acc[r][1]));
}

/* q8_row_avx2 for m (2..Q8_FEW) activation rows at once: a batch's decode step, a speculative
 * verification. Each span of a weight row is decoded once (its code vectors into a buffer in L1, its scales
 * into registers) and multiplied against each of X's m rows in turn; the weight row is read from memory
 * once for all of them. A row's sums and their order are q8_row_avx2's (R = 1), so each row has the bits it
 * has alone and among many (tests/test_activations_q8.py). What it saves over q8_run's tiles at a few rows:
 * decoding the tile, then packing and interleaving it, for only the few rows that use it. Its own cost is a
 * span's eight-lane reductions per activation row, which the tiles' interleaved lanes do not have: past five
 * rows the tiles are faster (docs/performance.md, "A few rows on AVX2"). The products and scaling of a span
 * are q8_row_avx2's written out again: the same lines as shared inline helpers made gcc schedule the one-row
 * kernel differently, 0.89-0.91x on 2,048-column Q4_K rows (both builds in one process, in both orders). */
AVX2 INLINE void q8_few_avx2(const int type, const int M, const uint8_t *w, Py_ssize_t pf, const struct q8x *X,
                             Py_ssize_t k, float *y, Py_ssize_t n) {
    const Py_ssize_t blocks = k / VALUES(type), per = 16 / GROUPS(type);
    const int vectors = type == GGML_Q6_K ? 8 : 16, wide = type == GGML_Q8_0;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[MAX_ROWS][2]; /* Q8_FEW <= MAX_ROWS */
    for (int i = 0; i < M; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (Py_ssize_t s = 0, j0 = 0; j0 < blocks; s++, j0 += per) {
        if (pf) ahead_of(w + j0 * BYTES(type) + pf, per * BYTES(type));
        __m256i codes[16];
        UNROLL for (int u = 0; u < vectors; u++) /* zeros past the row: their products are zeros, as q8_row_avx2's */
            codes[u] = span_vector(type, w, j0, blocks, u, wide);
        __m256 sc[2], bi[2];
        span_scales(type, w, j0, blocks, sc, bi);
        for (int i = 0; i < M; i++) {
            const int8_t *qs = X->q + i * X->kp + s * 32 * vectors;
            __m256i p[16], isum[2];
            UNROLL for (int u = 0; u < vectors; u++) {
                const __m256i c = codes[u], x = _mm256_loadu_si256((const __m256i *)(qs + 32 * u));
                p[u] = _mm256_madd_epi16(wide ? _mm256_maddubs_epi16(_mm256_abs_epi8(c), _mm256_sign_epi8(x, c))
                                              : _mm256_maddubs_epi16(c, x), ones);
            }
            if (vectors == 16) {
                isum[0] = eight_sums(p), isum[1] = eight_sums(p + 8);
            } else {
                isum[0] = eight_sums16(p), isum[1] = eight_sums16(p + 4);
            }
            for (int h = 0; h < 2; h++) {
                const Py_ssize_t g = i * X->lanes + s * 16 + h * 8;
                __m256i is = isum[h];
                if (wide) is = _mm256_add_epi32(is, _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)(X->qs + g)), 7));
                const __m256 t = _mm256_mul_ps(sc[h], _mm256_loadu_ps(X->dx + g));
                acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), t, acc[i][h]);
                acc[i][h] = _mm256_fmadd_ps(bi[h], _mm256_loadu_ps(X->xs + g), acc[i][h]);
            }
        }
    }
    for (int i = 0; i < M; i++) y[i * n] = hsum(_mm256_add_ps(acc[i][0], acc[i][1]));
}

/* Rows [r0, r1) of block-form W against X's m rows (2..Q8_FEW, each in column order), into y[i * n + r]:
 * a weight row a step, its spans asked for PREFETCH bytes ahead as they are read. */
AVX2 void q8_few_rows_avx2(int type, const uint8_t *raw, Py_ssize_t raw_row, Py_ssize_t r0, Py_ssize_t r1,
                           Py_ssize_t left, const struct q8x *X, Py_ssize_t m, float *y, Py_ssize_t k, Py_ssize_t n) {
    const Py_ssize_t ahead = (PREFETCH + raw_row - 1) / raw_row * raw_row;
    for (Py_ssize_t r = r0; r < r1; r++) {
        const Py_ssize_t pf = (r + 1) * raw_row + ahead <= left ? ahead : 0;
        const uint8_t *w = raw + r * raw_row;
#define FEW(M) q8_few_avx2(T, M, w, pf, X, k, y + r, n)
        switch (type) { /* m a constant through simd.h's ROWS_CASES (2..MAX_ROWS; Q8_FEW <= MAX_ROWS) */
#define TYPE_CASE(t) case t: { enum { T = t }; ROWS_CASES(FEW) break; }
        TYPE_CASE(GGML_Q4_0) TYPE_CASE(GGML_Q4_1) TYPE_CASE(GGML_Q5_0) TYPE_CASE(GGML_Q5_1) TYPE_CASE(GGML_Q8_0)
        TYPE_CASE(GGML_Q4_K) TYPE_CASE(GGML_Q5_K)
        default: { enum { T = GGML_Q6_K }; ROWS_CASES(FEW) break; }
#undef TYPE_CASE
        }
#undef FEW
    }
}

/* -- the affine forms -------------------------------------------------------------
 * The codes gemv.c's affine products read (a nibble a value, two groups of 16
 * columns a 16-byte group as GGML orders them; or a byte a value) with their
 * scales and biases in arrays of their own (float32, or float16 words with
 * `half`; no biases: factor * scale, as tile_scales makes them): the forms
 * Q5_0 and Q5_1 take at load where their blocks are not kept (AVX2) and
 * quantize="q8"/"q4" gives a Hugging Face model. The lanes and the float
 * arithmetic are the tile kernels' (q8_tile_avx2 after tile_scales), so a row
 * has the bits it gets among others. Without this a decode step's product on
 * them took q8_run's tile path, which packs every tile of W for one row: on
 * Gemma 3 (its Q5_0 tensors converted) q8 decode ran at a fifth of exact's
 * speed. AVX2 instructions, on the VNNI path too (the integer sums are exact
 * either way). */

/* Code vector u (32 columns) of an affine row from c: nibbles as unsigned codes, bytes as code - 128 (signed,
 * AVX2's sign trick for codes up to 255: the span's sums get 128 * sum(q) back). */
AVX2 INLINE __m256i affine_vector(const int bits, const uint8_t *c) {
    if (bits == 4) {
        const __m128i v = _mm_loadu_si128((const __m128i *)c), m4 = _mm_set1_epi8(15);
        return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m4), _mm_and_si128(v, m4));
    }
    return _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)c), _mm256_set1_epi8((char)0x80));
}

/* The first c (at most 8; none when c <= 0) of a row's per-group floats at p as lanes, +0 after them, read
 * no further than the c-th: float32, or float16 words with half. A row's last span (the matrix's last row's
 * included) ends inside a vector. */
AVX2 INLINE __m256 affine_lanes(const void *p, const int half, const Py_ssize_t c) {
    if (c >= 8) return half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)) : _mm256_loadu_ps((const float *)p);
    if (c <= 0) return _mm256_setzero_ps();
    if (!half)
        return _mm256_maskload_ps((const float *)p, _mm256_cmpgt_epi32(_mm256_set1_epi32((int)c),
                                                                      _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
    const uint16_t *h = (const uint16_t *)p;
    __m128i v = _mm_maskload_epi32((const int *)p, _mm_cmpgt_epi32(_mm_set1_epi32((int)(c / 2)), _mm_setr_epi32(0, 1, 2, 3)));
    switch (c) { /* an odd count's last word */
    case 1: v = _mm_insert_epi16(v, h[0], 0); break;
    case 3: v = _mm_insert_epi16(v, h[2], 2); break;
    case 5: v = _mm_insert_epi16(v, h[4], 4); break;
    case 7: v = _mm_insert_epi16(v, h[6], 6); break;
    default: break;
    }
    return _mm256_cvtph_ps(v);
}

/* R (1 or 2) affine rows (row_bytes of codes and `groups` scales apart) against X's row 0, into y[0..R):
 * q8_row_avx2's span loop on these codes (bits 4 or 8; g16: 8-bit codes in groups of 16). */
AVX2 INLINE void q8_affine_row(const int bits, const int g16, const int R, const uint8_t *codes, Py_ssize_t row_bytes,
                               const char *scales, const char *biases, float factor, int half, Py_ssize_t groups,
                               Py_ssize_t pf, const struct q8x *X, float *y) {
    const int vectors = g16 ? 8 : 16, vbytes = bits == 4 ? 16 : 32, each = half ? 2 : 4;
    const Py_ssize_t span_bytes = (Py_ssize_t)vectors * vbytes;
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256 vf = _mm256_set1_ps(factor);
    __m256 acc[2][2] = {{_mm256_setzero_ps(), _mm256_setzero_ps()}, {_mm256_setzero_ps(), _mm256_setzero_ps()}};
    for (Py_ssize_t s = 0, g0 = 0; g0 < groups; s++, g0 += 16)
      UNROLL for (int r = 0; r < R; r++) {
        const int8_t *qs = X->q + s * 32 * vectors;
        const uint8_t *w = codes + r * row_bytes + s * span_bytes;
        if (pf) ahead_of(w + pf, span_bytes);
        __m256i p[16], isum[2];
        UNROLL for (int u = 0; u < vectors; u++) {
            if (g0 + (g16 ? 2 * u : u) >= groups) { /* past the row */
                p[u] = _mm256_setzero_si256();
                continue;
            }
            const __m256i c = affine_vector(bits, w + u * vbytes), x = _mm256_loadu_si256((const __m256i *)(qs + 32 * u));
            p[u] = _mm256_madd_epi16(bits == 8 ? _mm256_maddubs_epi16(_mm256_abs_epi8(c), _mm256_sign_epi8(x, c))
                                               : _mm256_maddubs_epi16(c, x), ones);
        }
        if (g16) {
            isum[0] = eight_sums16(p), isum[1] = eight_sums16(p + 4);
        } else {
            isum[0] = eight_sums(p), isum[1] = eight_sums(p + 8);
        }
        for (int h = 0; h < 2; h++) {
            const Py_ssize_t g = g0 + 8 * h, live = groups - g;
            const Py_ssize_t at = (r * groups + g) * each;
            const __m256 sc = affine_lanes(scales + at, half, live);
            __m256 bi;
            if (biases) {
                bi = affine_lanes(biases + at, half, live);
            } else { /* factor * scale; +0 past the row, as the tile kernels' padding (factor * 0 may be -0) */
                const __m256 in = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(live > 8 ? 8 : (int)live),
                                                                        _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
                bi = _mm256_and_ps(in, _mm256_mul_ps(vf, sc));
            }
            __m256i is = isum[h];
            if (bits == 8) is = _mm256_add_epi32(is, _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)(X->qs + g)), 7));
            const __m256 t = _mm256_mul_ps(sc, _mm256_loadu_ps(X->dx + g));
            acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), t, acc[r][h]);
            acc[r][h] = _mm256_fmadd_ps(bi, _mm256_loadu_ps(X->xs + g), acc[r][h]);
        }
    }
    for (int r = 0; r < R; r++) y[r] = hsum(_mm256_add_ps(acc[r][0], acc[r][1]));
}

#define AFFINE_CASES(R, r)                                                                                             \
    {                                                                                                                  \
        const uint8_t *cr = codes + (r) * row_bytes;                                                                   \
        const char *sr = (const char *)scales + (r) * groups * each;                                                   \
        const char *br = biases ? (const char *)biases + (r) * groups * each : NULL;                                   \
        if (bits == 4)                                                                                                 \
            q8_affine_row(4, 0, R, cr, row_bytes, sr, br, factor, half, groups, pf, X, y + (r));                       \
        else if (group == 16)                                                                                          \
            q8_affine_row(8, 1, R, cr, row_bytes, sr, br, factor, half, groups, pf, X, y + (r));                       \
        else                                                                                                           \
            q8_affine_row(8, 0, R, cr, row_bytes, sr, br, factor, half, groups, pf, X, y + (r));                       \
    }

/* Rows [r0, r1) of an affine W (bits 4 with groups of 32, or 8 with groups of 32 or 16; codes, scales and
 * biases from its first row, `left` its bytes of codes) against X's row 0 in column order
 * (q8_quantize_natural_avx2), into y[r0..r1): Q8_ROWS' loop. */
AVX2 void q8_rows_affine_avx2(int bits, Py_ssize_t group, const uint8_t *codes, const void *scales, const void *biases,
                              float factor, int half, Py_ssize_t r0, Py_ssize_t r1, Py_ssize_t left, const struct q8x *X,
                              float *y, Py_ssize_t k) {
    const Py_ssize_t row_bytes = bits == 4 ? k / 2 : k, groups = k / group, each = half ? 2 : 4;
    Py_ssize_t r = r0;
    if (row_bytes > LONG_ROW) {
        const Py_ssize_t ahead = (PREFETCH + row_bytes - 1) / row_bytes * row_bytes;
        for (; r < r1; r++) {
            const Py_ssize_t pf = (r + 1) * row_bytes + ahead <= left ? ahead : 0;
            AFFINE_CASES(1, r)
        }
        return;
    }
    const Py_ssize_t pf = 0;
    for (; r < r1; r += 2) {
        const char *at = (const char *)codes + r * row_bytes;
        for (Py_ssize_t b = 0; b < 2 * row_bytes && r * row_bytes + PREFETCH + b < left; b += 64)
            __builtin_prefetch(at + PREFETCH + b, 0, PREFETCH_LOCALITY);
        if (r + 2 > r1) break;
        AFFINE_CASES(2, r)
    }
    if (r < r1) AFFINE_CASES(1, r)
}
#undef AFFINE_CASES

/* q8.c's q8_quantize_row in column order (natural), 32 values at a time: the
 * same float32 operations (max|x|, amax / 127, 127 / amax, x * id rounded to
 * nearest even by the conversion, as rintf does, clamped), so the same codes,
 * scales and sums; the portable loop calls rintf per value, which at one row
 * of a small model was a tenth of a product's time. */
AVX512 void q8_quantize_natural_512(const float *x, Py_ssize_t k, Py_ssize_t group, int8_t *q, float *dx, float *xs,
                                    int32_t *qs) {
    const __m512 lim = _mm512_set1_ps(127.0f);
    for (Py_ssize_t b = 0; b < k; b += 32) {
        const __m512 a0 = _mm512_loadu_ps(x + b), a1 = _mm512_loadu_ps(x + b + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a0), _mm512_abs_ps(a1)));
        const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
        const __m512 vid = _mm512_set1_ps(id);
        __m512i v0 = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(a0, vid), _mm512_sub_ps(_mm512_setzero_ps(), lim)), lim));
        __m512i v1 = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(a1, vid), _mm512_sub_ps(_mm512_setzero_ps(), lim)), lim));
        _mm_storeu_si128((__m128i *)(q + b), _mm512_cvtsepi32_epi8(v0));
        _mm_storeu_si128((__m128i *)(q + b + 16), _mm512_cvtsepi32_epi8(v1));
        if (group == 32) {
            const Py_ssize_t g = b / 32;
            dx[g] = d, qs[g] = _mm512_reduce_add_epi32(_mm512_add_epi32(v0, v1));
        } else { /* groups of 16: two a block, the same scale */
            const Py_ssize_t g = b / 16;
            dx[g] = dx[g + 1] = d, qs[g] = _mm512_reduce_add_epi32(v0), qs[g + 1] = _mm512_reduce_add_epi32(v1);
        }
    }
    for (Py_ssize_t g = 0; g < k / group; g++) xs[g] = dx[g] * (float)qs[g];
}

/* The same on AVX2. */
AVX2 void q8_quantize_natural_avx2(const float *x, Py_ssize_t k, Py_ssize_t group, int8_t *q, float *dx, float *xs,
                                   int32_t *qs) {
    const __m256 lim = _mm256_set1_ps(127.0f), nlim = _mm256_set1_ps(-127.0f), sign = _mm256_set1_ps(-0.0f);
    for (Py_ssize_t b = 0; b < k; b += 32) {
        __m256 a[4], m = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) a[i] = _mm256_loadu_ps(x + b + 8 * i), m = _mm256_max_ps(m, _mm256_andnot_ps(sign, a[i]));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        const float amax = _mm_cvtss_f32(h);
        const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
        const __m256 vid = _mm256_set1_ps(id);
        __m256i v[4];
        for (int i = 0; i < 4; i++) v[i] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(a[i], vid), nlim), lim));
        /* packs keep the order inside 128-bit lanes: [0..3 8..11 4..7 12..15] per pair, fixed by one permute */
        const __m256i w = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
        _mm256_storeu_si256((__m256i *)(q + b), _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        const __m256i s01 = _mm256_add_epi32(v[0], v[1]), s23 = _mm256_add_epi32(v[2], v[3]);
        if (group == 32) {
            const Py_ssize_t g = b / 32;
            __m256i t = _mm256_add_epi32(s01, s23);
            __m128i u = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
            u = _mm_add_epi32(u, _mm_shuffle_epi32(u, _MM_SHUFFLE(1, 0, 3, 2)));
            u = _mm_add_epi32(u, _mm_shuffle_epi32(u, _MM_SHUFFLE(2, 3, 0, 1)));
            dx[g] = d, qs[g] = _mm_cvtsi128_si32(u);
        } else {
            const Py_ssize_t g = b / 16;
            for (int i = 0; i < 2; i++) {
                const __m256i t = i ? s23 : s01;
                __m128i u = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
                u = _mm_add_epi32(u, _mm_shuffle_epi32(u, _MM_SHUFFLE(1, 0, 3, 2)));
                u = _mm_add_epi32(u, _mm_shuffle_epi32(u, _MM_SHUFFLE(2, 3, 0, 1)));
                dx[g + i] = d, qs[g + i] = _mm_cvtsi128_si32(u);
            }
        }
    }
    for (Py_ssize_t g = 0; g < k / group; g++) xs[g] = dx[g] * (float)qs[g];
}

/* The row loops, two rows a step, the type a constant in each (the kernels above are specialised per type),
 * X's row i into y[i * n + r]. q8_rows_vnni and q8_rows_avx2 take X's row 0 (a decode step); q8_few_rows_vnni
 * takes its m rows (2..Q8_FEW_VNNI: a small batch's decode step, a speculative verification) one after
 * another, so each step's weight rows come from memory once and from L1 for the rows after the first. Each row's
 * sums are those it gets alone (the same kernel), so the bits are q8_run's. On VNNI that costs less than q8_run's
 * tiles (decoded, then packed into the interleaved order) for a few rows, though the codes are taken out of the
 * blocks again for every row: docs/performance.md, "A few rows on AVX-512". Only row 0 asks for the spans ahead
 * (pf). One function for both counts, its row loop around each step, ran the decode step's single row 1.02-1.09x
 * slower (gcc schedules it apart), hence two instantiations of one loop. */
#define Q8_TYPE(row, R, r, i, pf)                                                                                     \
    {                                                                                                                 \
        const Py_ssize_t at_ = (i) * X->lanes;                                                                        \
        const int8_t *q_ = X->q + (i) * X->kp;                                                                        \
        float *y_ = y + (i) * n + (r);                                                                                \
        switch (type) {                                                                                               \
        case GGML_Q4_0: row(GGML_Q4_0, R, raw + (r) * raw_row, raw_row, pf, q_, X->dx + at_, X->xs + at_, X->qs + at_, k, y_); break; \
        case GGML_Q4_1: row(GGML_Q4_1, R, raw + (r) * raw_row, raw_row, pf, q_, X->dx + at_, X->xs + at_, X->qs + at_, k, y_); break; \
        case GGML_Q5_0: row(GGML_Q5_0, R, raw + (r) * raw_row, raw_row, pf, q_, X->dx + at_, X->xs + at_, X->qs + at_, k, y_); break; \
        case GGML_Q5_1: row(GGML_Q5_1, R, raw + (r) * raw_row, raw_row, pf, q_, X->dx + at_, X->xs + at_, X->qs + at_, k, y_); break; \
        case GGML_Q8_0: row(GGML_Q8_0, R, raw + (r) * raw_row, raw_row, pf, q_, X->dx + at_, X->xs + at_, X->qs + at_, k, y_); break; \
        case GGML_Q4_K: row(GGML_Q4_K, R, raw + (r) * raw_row, raw_row, pf, q_, X->dx + at_, X->xs + at_, X->qs + at_, k, y_); break; \
        case GGML_Q5_K: row(GGML_Q5_K, R, raw + (r) * raw_row, raw_row, pf, q_, X->dx + at_, X->xs + at_, X->qs + at_, k, y_); break; \
        default: row(GGML_Q6_K, R, raw + (r) * raw_row, raw_row, pf, q_, X->dx + at_, X->xs + at_, X->qs + at_, k, y_); break; \
        }                                                                                                             \
    }
/* The activation rows a function takes: row 0 alone, or X's m rows in turn. */
#define ROW_ZERO(step) { const Py_ssize_t i = 0; step }
#define EACH_ROW(step) for (Py_ssize_t i = 0; i < m; i++) step
#define Q8_ROWS(name, row, attr, ROWS)                                                                                \
    attr void name(int type, const uint8_t *raw, Py_ssize_t raw_row, Py_ssize_t r0, Py_ssize_t r1, Py_ssize_t left,    \
                   const struct q8x *X, Py_ssize_t m, float *y, Py_ssize_t k, Py_ssize_t n) {                          \
        (void)m;                                                                                                       \
        Py_ssize_t r = r0;                                                                                             \
        if (raw_row > LONG_ROW) { /* a row a step, its spans asked for as they are read */                             \
            const Py_ssize_t ahead = (PREFETCH + raw_row - 1) / raw_row * raw_row;                                     \
            for (; r < r1; r++) {                                                                                      \
                const Py_ssize_t pf = (r + 1) * raw_row + ahead <= left ? ahead : 0;                                   \
                ROWS(Q8_TYPE(row, 1, r, i, i ? 0 : pf))                                                                \
            }                                                                                                          \
            return;                                                                                                    \
        }                                                                                                              \
        for (; r < r1; r += 2) { /* two rows a step, asked for all at once */                                          \
            const char *at = (const char *)raw + r * raw_row;                                                          \
            for (Py_ssize_t b = 0; b < 2 * raw_row && r * raw_row + PREFETCH + b < left; b += 64)                      \
                __builtin_prefetch(at + PREFETCH + b, 0, PREFETCH_LOCALITY);                                           \
            if (r + 2 > r1) break;                                                                                     \
            ROWS(Q8_TYPE(row, 2, r, i, 0))                                                                             \
        }                                                                                                              \
        if (r < r1) ROWS(Q8_TYPE(row, 1, r, i, 0))                                                                     \
    }

Q8_ROWS(q8_rows_vnni, q8_row_vnni, AVX512VNNI, ROW_ZERO)
Q8_ROWS(q8_few_rows_vnni, q8_row_vnni, AVX512VNNI, EACH_ROW)
Q8_ROWS(q8_rows_avx2, q8_row_avx2, AVX2, ROW_ZERO)
#undef Q8_ROWS
#undef ROW_ZERO
#undef EACH_ROW
#undef Q8_TYPE
#endif
