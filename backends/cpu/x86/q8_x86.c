/* q8.c's integer products on x86: AVX-512 VNNI (vpdpbusd) and AVX2 (vpmaddubsw,
 * vpmaddwd), and the packing of a tile's codes into the interleaved order,
 * sixteen groups at a time (one packing kernel for both paths). The same lanes and sums as q8.c's portable loops. */

#include "simd.h"

/* Without -fwrapv, which Python's build flags give every extension: with it gcc keeps the blocks' wrapping
 * index arithmetic in the inner loops, and the 4 x 3 VNNI block below ran at 0.73x the speed of the 4 x 2 block before it
 * (docs/performance.md, "The int8 prefill kernel"). Nothing here relies on signed overflow wrapping. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-wrapv")
#endif

#ifdef HAVE_X86
/* The VNNI block: Q8_RB weight rows by Q8_JB activation rows. 4 x 3 took 0.87-0.97x the time of the 4 x 2
 * block before it on Q4_K products of 128 rows; 4 x 4 was slower, its 16 float accumulators no longer fitting
 * beside the 16 integer ones (docs/performance.md, "The int8 prefill kernel"). -D to try others. */
#ifndef Q8_RB
#define Q8_RB 4
#endif
#ifndef Q8_JB
#define Q8_JB 3
#endif
/* Groups of 16 (Q6_K) apply their scales twice as often for the same integer work, and take Q8_JB16 activation
 * rows: with the operands on cache lines Q6_K's products ran in 0.79-0.91x the time of 4 x 2 at 4 x 4 (and 4 x 3
 * was slower than 4 x 2 at k = 2048), docs/performance.md "Q6_K's tiles four rows by four". */
#ifndef Q8_JB16
#define Q8_JB16 4
#endif
/* Four rows of four 32-bit lanes per 128-bit half transposed: r[j]'s lane c goes to r[c]'s lane j, in each
 * half. */
AVX2 INLINE void transpose4x4(__m256i *r) {
    const __m256i t0 = _mm256_unpacklo_epi32(r[0], r[1]), t1 = _mm256_unpackhi_epi32(r[0], r[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(r[2], r[3]), t3 = _mm256_unpackhi_epi32(r[2], r[3]);
    r[0] = _mm256_unpacklo_epi64(t0, t2), r[1] = _mm256_unpackhi_epi64(t0, t2);
    r[2] = _mm256_unpacklo_epi64(t1, t3), r[3] = _mm256_unpackhi_epi64(t1, t3);
}

/* q8.c's q8_pack_row on AVX2 for the first `spans` whole spans of a row (sixteen groups each): the 4-byte
 * chunks transposed in registers, where the portable loop moved them one memcpy at a time (5% of a 1B
 * model's q8 prefill samples on the Zen 3, 15% with a batch's short prompts). Groups of 32 bytes: two
 * transposes of 8 x 8 chunks; groups of 16 bytes, or of 32 values in 16 bytes of nibbles: four groups'
 * four chunks a 128-bit half, the nibbles split after (chunk c of a 4-bit group: the low nibbles of its
 * bytes' dword c, chunk c + 4 the high ones, as q8_pack_row unpacks them). The same bytes as q8_pack_row.
 * The AVX-512 path packs with it too: its own kernel gathered each chunk of sixteen groups (vpgatherdd), and on
 * a Zen 4 that made a product of 8 rows take 1.28-1.40x the time it takes with these transposes, of 128 rows
 * 1.02-1.05x (docs/performance.md, "Packing without gathers"). */
AVX2 void q8_pack_spans_avx2(int bits, const uint8_t *cr, Py_ssize_t spans, Py_ssize_t group, uint8_t *out) {
    const __m256i low = _mm256_set1_epi8(15);
    for (Py_ssize_t s = 0; s < spans; s++) {
        uint8_t *o = out + s * Q8_LANES * group;
        if (bits == 8 && group == 32) {
            const uint8_t *g = cr + s * Q8_LANES * 32;
            for (int h = 0; h < 2; h++) { /* groups 8h..8h+7 */
                __m256i r[8];
                for (int j = 0; j < 8; j++) r[j] = _mm256_loadu_si256((const __m256i *)(g + (8 * h + j) * 32));
                /* r[c]: chunk c of groups 8h..8h+3 | chunk c + 4 of them; r[4 + c]: the same of 8h+4..8h+7 */
                transpose4x4(r), transpose4x4(r + 4);
                for (int c = 0; c < 4; c++) {
                    _mm256_storeu_si256((__m256i *)(o + c * 64 + h * 32), _mm256_permute2x128_si256(r[c], r[c + 4], 0x20));
                    _mm256_storeu_si256((__m256i *)(o + (c + 4) * 64 + h * 32), _mm256_permute2x128_si256(r[c], r[c + 4], 0x31));
                }
            }
            continue;
        }
        const uint8_t *g = cr + s * Q8_LANES * 16; /* 16 bytes a group */
        for (int q = 0; q < 2; q++) { /* groups 4q..4q+3 in the low halves, 8 + 4q.. in the high */
            __m256i r[4];
            for (int j = 0; j < 4; j++)
                r[j] = _mm256_set_m128i(_mm_loadu_si128((const __m128i *)(g + (8 + 4 * q + j) * 16)),
                                        _mm_loadu_si128((const __m128i *)(g + (4 * q + j) * 16)));
            transpose4x4(r); /* r[c]: chunk c of the four groups in each half */
            for (int c = 0; c < 4; c++) {
                const __m256i v = bits == 4 ? _mm256_and_si256(r[c], low) : r[c];
                _mm_storeu_si128((__m128i *)(o + c * 64 + q * 16), _mm256_castsi256_si128(v));
                _mm_storeu_si128((__m128i *)(o + c * 64 + 32 + q * 16), _mm256_extracti128_si256(v, 1));
                if (bits == 4) {
                    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(r[c], 4), low);
                    _mm_storeu_si128((__m128i *)(o + (c + 4) * 64 + q * 16), _mm256_castsi256_si128(hi));
                    _mm_storeu_si128((__m128i *)(o + (c + 4) * 64 + 32 + q * 16), _mm256_extracti128_si256(hi, 1));
                }
            }
        }
    }
}

/* R (up to 4) weight rows against J (up to 4) activation rows, C chunks a group (8: groups of 32, 4: of 16);
 * constants where called. Each chunk's R rows of codes are loaded once and multiplied with J rows of q: 12
 * vpdpbusd for 7 loads at 4 x 3 (the 4 x 2 block before: 8 for 6). Per span and pair of rows, the lanes' scales
 * are applied in two fused multiply-adds (before: two multiplies and two adds), as every path does. */
AVX512VNNI INLINE void q8_block_vnni(const uint8_t *wq, const float *ws, const float *wb, const struct q8x *X, Py_ssize_t j,
                          float *y, Py_ssize_t n, const int R, const int J, const int C) {
    __m512 acc[4][4];
    for (int r = 0; r < R; r++)
        for (int i = 0; i < J; i++) acc[r][i] = _mm512_setzero_ps();
    const Py_ssize_t kp = X->kp, lanes = X->lanes;
    const int8_t *xq = X->q + j * kp;
    for (Py_ssize_t s = 0; s < X->spans; s++) {
        __m512i isum[4][4];
        for (int r = 0; r < R; r++)
            for (int i = 0; i < J; i++) isum[r][i] = _mm512_setzero_si512();
        const Py_ssize_t o = s * C * 64;
        for (int c = 0; c < C; c++) {
            __m512i w[4];
            for (int r = 0; r < R; r++) w[r] = _mm512_loadu_si512(wq + r * kp + o + c * 64);
            for (int i = 0; i < J; i++) {
                const __m512i q = _mm512_loadu_si512(xq + i * kp + o + c * 64);
                for (int r = 0; r < R; r++) isum[r][i] = _mm512_dpbusd_epi32(isum[r][i], w[r], q);
            }
        }
        for (int i = 0; i < J; i++) {
            const __m512 dx = _mm512_loadu_ps(X->dx + (j + i) * lanes + s * 16),
                         xs = _mm512_loadu_ps(X->xs + (j + i) * lanes + s * 16);
            for (int r = 0; r < R; r++) {
                const __m512 t = _mm512_mul_ps(_mm512_loadu_ps(ws + r * lanes + s * 16), dx);
                acc[r][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r][i]), t, acc[r][i]);
                acc[r][i] = _mm512_fmadd_ps(_mm512_loadu_ps(wb + r * lanes + s * 16), xs, acc[r][i]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int i = 0; i < J; i++) y[(j + i) * n + r] = hsum(half_sum(acc[r][i]));
}

#define Q8_VNNI_J(R_, J_)                                                                                            \
    case R_ * 8 + J_:                                                                                                \
        if (C == 8) q8_block_vnni(w, s, b, X, j, y + r0, n, R_, J_, 8);                                              \
        else q8_block_vnni(w, s, b, X, j, y + r0, n, R_, J_, 4);                                                     \
        break;
#define Q8_VNNI_R(R_) Q8_VNNI_J(R_, 1) Q8_VNNI_J(R_, 2) Q8_VNNI_J(R_, 3) Q8_VNNI_J(R_, 4)

AVX512VNNI void q8_tile_vnni(const uint8_t *wq, const float *ws, const float *wb, Py_ssize_t rows,
                             const struct q8x *X, Py_ssize_t m, float *y, Py_ssize_t n) {
    const int C = (int)(X->group / 4);
    const int jb = C == 8 ? Q8_JB : Q8_JB16;
    for (Py_ssize_t r0 = 0; r0 < rows; r0 += Q8_RB) {
        const int R = rows - r0 < Q8_RB ? (int)(rows - r0) : Q8_RB;
        const uint8_t *w = wq + r0 * X->kp;
        const float *s = ws + r0 * X->lanes, *b = wb + r0 * X->lanes;
        for (Py_ssize_t j = 0; j < m; j += jb) {
            const int J = m - j < jb ? (int)(m - j) : jb;
            switch (R * 8 + J) { Q8_VNNI_R(1) Q8_VNNI_R(2) Q8_VNNI_R(3) Q8_VNNI_R(4) }
        }
    }
}
#undef Q8_VNNI_R
#undef Q8_VNNI_J

/* AVX2: the same lanes as two halves of eight, taken in turn; wide (codes above 127): signed codes and
 * 128 * sum(q) added. vpmaddubsw leaves in each 16-bit lane two products code * q (|q| <= 127), and S chunks
 * of them are summed in 16 bits before one vpmaddwd widens them to the group's 32-bit lane: S = 8 for 4-bit
 * codes (8 * 2 * 15 * 127 = 30480 < 2^15), 4 for 5-bit, 2 for Q6_K's 6-bit; wide codes (S = 0) a vpmaddwd
 * and an add a chunk. Integer sums either way, so the same bits.
 *
 * A block of Q8_AVX2_RB = 4 weight rows by 2 activation rows: eight 16-bit sums, two rows of q and one of
 * codes in registers. The sums are named variables added in place (the asm), and the chunk loop stays
 * rolled: written over arrays, or unrolled, gcc kept two registers per sum (an add into a temporary, then a
 * move back), spilled one to the stack, and that sum, carried through memory, held each pass of the loop to
 * a store's latency; the block ran no faster than the vpmaddwd-per-chunk one before it. Now Q4_K's products
 * run 1.25x faster (docs/performance.md, "The AVX2 int8 tile kernel's 16-bit sums"). 2 x 2 and 3 x 2 blocks
 * timed alike; 4 x 2 reads q from L2 half as often.
 *
 * A last span with at most eight groups (SmolLM2's 576 columns: 16 + 2 groups) skips its second half, all
 * padding: those lanes would add (float)0 * t and 0 * 0 to their sums, and a sum is never -0 (it starts at
 * +0, and a fused multiply-add gives -0 only from a -0 addend), so leaving them out keeps the bits. */
#define Q8_AVX2_RB 4

AVX2 INLINE __m256i q8_pairs_avx2(__m256i w, __m256i q, const int wide) {
    const __m256i signed_w = _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80));
    return wide ? _mm256_maddubs_epi16(_mm256_abs_epi8(signed_w), _mm256_sign_epi8(q, signed_w))
                : _mm256_maddubs_epi16(w, q);
}

#define Q8_MB(a, r, i)                                                                                               \
    do {                                                                                                             \
        const __m256i p_ = _mm256_maddubs_epi16(w##r, q##i);                                                         \
        __asm__("vpaddw %1, %0, %0" : "+x"(a) : "x"(p_));                                                            \
    } while (0)

AVX2 INLINE void q8_block_avx2(const uint8_t *wq, const float *ws, const float *wb, const struct q8x *X, Py_ssize_t j,
                               float *y, Py_ssize_t n, const int R, const int J, const int C, const int S) {
    const int wide = S == 0, step = wide ? 1 : S;
    __m256 acc[Q8_AVX2_RB][2][2];
    for (int r = 0; r < R; r++)
        for (int i = 0; i < J; i++) acc[r][i][0] = acc[r][i][1] = _mm256_setzero_ps();
    const Py_ssize_t kp = X->kp, lanes = X->lanes;
    const __m256i ones = _mm256_set1_epi16(1);
    const uint8_t *w0p = wq, *w1p = wq + kp, *w2p = wq + 2 * kp, *w3p = wq + 3 * kp;
    const int8_t *q0p = X->q + j * kp, *q1p = q0p + kp;
    for (Py_ssize_t s = 0; s < X->spans; s++)
        for (int h = 0; h < (X->groups - s * 16 > 8 ? 2 : 1); h++) { /* a last span's empty half left out */
            __m256i isum[Q8_AVX2_RB][2];
            const Py_ssize_t o = s * C * 64 + h * 32;
            for (int c0 = 0; c0 < C; c0 += step) {
                const Py_ssize_t f = o + c0 * 64; /* the first chunk sets the sums */
                const __m256i fq0 = _mm256_loadu_si256((const __m256i *)(q0p + f)),
                              fq1 = J > 1 ? _mm256_loadu_si256((const __m256i *)(q1p + f)) : fq0,
                              fw0 = _mm256_loadu_si256((const __m256i *)(w0p + f)),
                              fw1 = R > 1 ? _mm256_loadu_si256((const __m256i *)(w1p + f)) : fw0,
                              fw2 = R > 2 ? _mm256_loadu_si256((const __m256i *)(w2p + f)) : fw0,
                              fw3 = R > 3 ? _mm256_loadu_si256((const __m256i *)(w3p + f)) : fw0;
                __m256i a00 = q8_pairs_avx2(fw0, fq0, wide), a01 = q8_pairs_avx2(fw0, fq1, wide),
                        a10 = q8_pairs_avx2(fw1, fq0, wide), a11 = q8_pairs_avx2(fw1, fq1, wide),
                        a20 = q8_pairs_avx2(fw2, fq0, wide), a21 = q8_pairs_avx2(fw2, fq1, wide),
                        a30 = q8_pairs_avx2(fw3, fq0, wide), a31 = q8_pairs_avx2(fw3, fq1, wide);
                if (!wide) { /* further chunks */
                    Py_ssize_t end = o + (c0 + step) * 64;
                    __asm__("" : "+r"(end)); /* keeps the loop rolled */
                    for (Py_ssize_t oc = f + 64; oc < end; oc += 64) {
                        const __m256i q0 = _mm256_loadu_si256((const __m256i *)(q0p + oc)),
                                      q1 = J > 1 ? _mm256_loadu_si256((const __m256i *)(q1p + oc)) : q0;
                        const __m256i w0 = _mm256_loadu_si256((const __m256i *)(w0p + oc));
                        Q8_MB(a00, 0, 0);
                        if (J > 1) Q8_MB(a01, 0, 1);
                        if (R > 1) {
                            const __m256i w1 = _mm256_loadu_si256((const __m256i *)(w1p + oc));
                            Q8_MB(a10, 1, 0);
                            if (J > 1) Q8_MB(a11, 1, 1);
                        }
                        if (R > 2) {
                            const __m256i w2 = _mm256_loadu_si256((const __m256i *)(w2p + oc));
                            Q8_MB(a20, 2, 0);
                            if (J > 1) Q8_MB(a21, 2, 1);
                        }
                        if (R > 3) {
                            const __m256i w3 = _mm256_loadu_si256((const __m256i *)(w3p + oc));
                            Q8_MB(a30, 3, 0);
                            if (J > 1) Q8_MB(a31, 3, 1);
                        }
                    }
                }
                const __m256i a[4][2] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31}};
                for (int r = 0; r < R; r++)
                    for (int i = 0; i < J; i++) {
                        const __m256i p = _mm256_madd_epi16(a[r][i], ones);
                        isum[r][i] = c0 == 0 ? p : _mm256_add_epi32(isum[r][i], p);
                    }
            }
            const Py_ssize_t g = s * 16 + h * 8;
            for (int r = 0; r < R; r++) {
                const __m256 sw = _mm256_loadu_ps(ws + r * lanes + g), bw = _mm256_loadu_ps(wb + r * lanes + g);
                for (int i = 0; i < J; i++) {
                    __m256i is = isum[r][i];
                    if (wide)
                        is = _mm256_add_epi32(is, _mm256_slli_epi32(
                                                      _mm256_loadu_si256((const __m256i *)(X->qs + (j + i) * lanes + g)), 7));
                    const __m256 t = _mm256_mul_ps(sw, _mm256_loadu_ps(X->dx + (j + i) * lanes + g));
                    acc[r][i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), t, acc[r][i][h]);
                    acc[r][i][h] = _mm256_fmadd_ps(bw, _mm256_loadu_ps(X->xs + (j + i) * lanes + g), acc[r][i][h]);
                }
            }
        }
    for (int r = 0; r < R; r++)
        for (int i = 0; i < J; i++) y[(j + i) * n + r] = hsum(_mm256_add_ps(acc[r][i][0], acc[r][i][1]));
}
#undef Q8_MB

/* code_max: the largest code W's form holds (15, 31, 63; larger codes take the wide path, right for any byte). */
AVX2 void q8_tile_avx2(const uint8_t *wq, const float *ws, const float *wb, Py_ssize_t rows,
                       const struct q8x *X, Py_ssize_t m, float *y, Py_ssize_t n, int code_max) {
    const int C = X->group == 32 ? 8 : 4;
    int S = code_max > 63 ? 0 : code_max <= 15 ? 8 : code_max <= 31 ? 4 : 2;
    if (S > C) S = C;
    for (Py_ssize_t r0 = 0; r0 < rows; r0 += Q8_AVX2_RB) {
        const int R = rows - r0 < Q8_AVX2_RB ? (int)(rows - r0) : Q8_AVX2_RB;
        const uint8_t *w = wq + r0 * X->kp;
        const float *s = ws + r0 * X->lanes, *b = wb + r0 * X->lanes;
        for (Py_ssize_t j = 0; j < m; j += 2) {
            const int J = m - j < 2 ? 1 : 2;
            switch (((R * 4 + J) * 2 + (C == 8)) * 16 + S) {
#define Q8_AVX2_CASE(R_, J_, C_, S_)                                                                                 \
    case (((R_ * 4 + J_) * 2 + (C_ == 8)) * 16 + S_): q8_block_avx2(w, s, b, X, j, y + r0, n, R_, J_, C_, S_); break;
#define Q8_AVX2_RJ(R_, J_)                                                                                           \
    Q8_AVX2_CASE(R_, J_, 8, 0) Q8_AVX2_CASE(R_, J_, 8, 2) Q8_AVX2_CASE(R_, J_, 8, 4) Q8_AVX2_CASE(R_, J_, 8, 8)      \
    Q8_AVX2_CASE(R_, J_, 4, 0) Q8_AVX2_CASE(R_, J_, 4, 2) Q8_AVX2_CASE(R_, J_, 4, 4)
                Q8_AVX2_RJ(1, 1) Q8_AVX2_RJ(1, 2) Q8_AVX2_RJ(2, 1) Q8_AVX2_RJ(2, 2)
                Q8_AVX2_RJ(3, 1) Q8_AVX2_RJ(3, 2) Q8_AVX2_RJ(4, 1) Q8_AVX2_RJ(4, 2)
#undef Q8_AVX2_RJ
#undef Q8_AVX2_CASE
            }
        }
    }
}

/* The peaks the products are measured against (benchmarks/q8_gemm.py): twelve independent chains of one
 * instruction kind, enough to cover its latency on the CPUs seen, the operands kept in registers, so a loop
 * runs at the instructions' throughput. Each returns the multiply-adds done (for the caller to time). The
 * empty asm keeps the compiler from folding a loop-invariant operand out of the loop. */
#define PEAK_CHAINS 12
AVX512VNNI double peak_vnni512(long iterations) {
    __m512i a[PEAK_CHAINS], w = _mm512_set1_epi8(3), q = _mm512_set1_epi8(5);
    for (int i = 0; i < PEAK_CHAINS; i++) a[i] = _mm512_set1_epi32(i);
    for (long it = 0; it < iterations; it++) {
        for (int i = 0; i < PEAK_CHAINS; i++) a[i] = _mm512_dpbusd_epi32(a[i], w, q);
        __asm__ volatile("" : "+v"(w), "+v"(q));
    }
    int32_t sink = 0;
    for (int i = 0; i < PEAK_CHAINS; i++) sink += _mm512_reduce_add_epi32(a[i]);
    __asm__ volatile("" : : "r"(sink));
    return (double)iterations * PEAK_CHAINS * 64;
}
/* AVX2's int8 product as the q8 kernel does it: vpmaddubsw, vpmaddwd by ones, an add. The chain's own sums
 * are the unsigned operand, so no product is loop-invariant. */
AVX2 double peak_maddubs256(long iterations) {
    __m256i a[PEAK_CHAINS], q = _mm256_set1_epi8(5);
    const __m256i ones = _mm256_set1_epi16(1);
    for (int i = 0; i < PEAK_CHAINS; i++) a[i] = _mm256_set1_epi32(i);
    for (long it = 0; it < iterations; it++) {
        for (int i = 0; i < PEAK_CHAINS; i++)
            a[i] = _mm256_add_epi32(a[i], _mm256_madd_epi16(_mm256_maddubs_epi16(a[i], q), ones));
        __asm__ volatile("" : "+v"(q));
    }
    int32_t sink = 0;
    for (int i = 0; i < PEAK_CHAINS; i++) sink += _mm256_extract_epi32(a[i], 0);
    __asm__ volatile("" : : "r"(sink));
    return (double)iterations * PEAK_CHAINS * 32;
}
AVX512 double peak_fma512(long iterations) {
    __m512 a[PEAK_CHAINS], w = _mm512_set1_ps(1.0f), b = _mm512_set1_ps(0.0f);
    for (int i = 0; i < PEAK_CHAINS; i++) a[i] = _mm512_set1_ps((float)i);
    for (long it = 0; it < iterations; it++) {
        for (int i = 0; i < PEAK_CHAINS; i++) a[i] = _mm512_fmadd_ps(a[i], w, b);
        __asm__ volatile("" : "+v"(w), "+v"(b));
    }
    float sink = 0.0f;
    for (int i = 0; i < PEAK_CHAINS; i++) sink += _mm512_reduce_add_ps(a[i]);
    __asm__ volatile("" : : "x"(sink));
    return (double)iterations * PEAK_CHAINS * 16;
}
AVX2 double peak_fma256(long iterations) {
    __m256 a[PEAK_CHAINS], w = _mm256_set1_ps(1.0f), b = _mm256_set1_ps(0.0f);
    for (int i = 0; i < PEAK_CHAINS; i++) a[i] = _mm256_set1_ps((float)i);
    for (long it = 0; it < iterations; it++) {
        for (int i = 0; i < PEAK_CHAINS; i++) a[i] = _mm256_fmadd_ps(a[i], w, b);
        __asm__ volatile("" : "+v"(w), "+v"(b));
    }
    float sink = 0.0f;
    for (int i = 0; i < PEAK_CHAINS; i++) sink += _mm256_cvtss_f32(a[i]);
    __asm__ volatile("" : : "x"(sink));
    return (double)iterations * PEAK_CHAINS * 8;
}
#endif
