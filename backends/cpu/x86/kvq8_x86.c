/* attention.c's q8_0 scores on AVX2: per block, vpsignb/vpabsb then vpmaddubsw
 * and vpmaddwd (ggml's form for q8_0 dot products), the eight int32 lanes summed
 * exactly, four query heads at once; then the same float arithmetic as the
 * portable q8_0_scores, in the same order, so the bits are the same. And on
 * AVX-512 VNNI (q8_0_scores_vnni, below) sixteen keys at a time. */

#include "simd.h"

#ifdef HAVE_X86

/* The eight int32 partial sums of one block: k's codes against q's. */
AVX2 static inline __m256i block_dot(__m256i ak, __m256i k, const int8_t *q) {
    const __m256i sq = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)q), k);
    return _mm256_madd_epi16(_mm256_maddubs_epi16(ak, sq), _mm256_set1_epi16(1));
}

AVX2 static inline int32_t isum8(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

AVX2 void q8_0_scores_avx2(const uint8_t *const *keys, Py_ssize_t n, const int8_t *q, const float *qd,
                           Py_ssize_t heads, Py_ssize_t blocks, float *s, Py_ssize_t stride) {
    for (Py_ssize_t j = 0; j < n; j++) {
        if (j + 8 < n)
            for (Py_ssize_t c = 0; c < blocks * Q8_0_BYTES; c += 64) _mm_prefetch((const char *)keys[j + 8] + c, _MM_HINT_T0);
        Py_ssize_t g = 0;
        for (; g + 4 <= heads; g += 4) {
            __m128 acc = _mm_setzero_ps();
            for (Py_ssize_t b = 0; b < blocks; b++) {
                const uint8_t *blk = keys[j] + b * Q8_0_BYTES;
                uint16_t h;
                memcpy(&h, blk, 2);
                const __m256i k = _mm256_loadu_si256((const __m256i *)(blk + 2)), ak = _mm256_sign_epi8(k, k);
                const int8_t *qb = q + (g * blocks + b) * 32;
                const Py_ssize_t hs = blocks * 32;
                const __m256i p01 = _mm256_hadd_epi32(block_dot(ak, k, qb), block_dot(ak, k, qb + hs));
                const __m256i p23 = _mm256_hadd_epi32(block_dot(ak, k, qb + 2 * hs), block_dot(ak, k, qb + 3 * hs));
                const __m256i p = _mm256_hadd_epi32(p01, p23);
                const __m128i isum = _mm_add_epi32(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1));
                const float *d = qd + g * blocks + b;
                const __m128 dd = _mm_mul_ps(_mm_set1_ps(_cvtsh_ss(h)), _mm_setr_ps(d[0], d[blocks], d[2 * blocks],
                                                                                      d[3 * blocks]));
                acc = _mm_add_ps(acc, _mm_mul_ps(_mm_cvtepi32_ps(isum), dd));
            }
            float r[4];
            _mm_storeu_ps(r, acc);
            for (int u = 0; u < 4; u++) s[(g + u) * stride + j] = r[u];
        }
        for (; g < heads; g++) {
            float acc = 0.0f;
            for (Py_ssize_t b = 0; b < blocks; b++) {
                const uint8_t *blk = keys[j] + b * Q8_0_BYTES;
                uint16_t h;
                memcpy(&h, blk, 2);
                const __m256i k = _mm256_loadu_si256((const __m256i *)(blk + 2)), ak = _mm256_sign_epi8(k, k);
                acc += (float)isum8(block_dot(ak, k, q + (g * blocks + b) * 32)) * (_cvtsh_ss(h) * qd[g * blocks + b]);
            }
            s[g * stride + j] = acc;
        }
    }
}

/* The eight-lane sums of sixteen keys' two blocks, A[p] lanes 0-7 block b and 8-15
 * block b + 1 of key p: three levels of pairwise shuffles and adds (integers: any
 * order gives the same sums), then each block's sixteen sums put in key order. */
AVX512VNNI INLINE void fold_keys(const __m512i *A, __m512i *first, __m512i *second) {
    __m512i R[8], S[4], U[2];
    for (int k = 0; k < 8; k++) /* lanes i + i+4 of each block: [key 2k b, b+1, key 2k+1 b, b+1] four each */
        R[k] = _mm512_add_epi32(_mm512_shuffle_i32x4(A[2 * k], A[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                                _mm512_shuffle_i32x4(A[2 * k], A[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int k = 0; k < 4; k++) /* and + i+2 */
        S[k] = _mm512_add_epi32(_mm512_unpacklo_epi64(R[2 * k], R[2 * k + 1]),
                                _mm512_unpackhi_epi64(R[2 * k], R[2 * k + 1]));
    for (int k = 0; k < 2; k++) { /* and + i+1 */
        const __m512 a = _mm512_castsi512_ps(S[2 * k]), b = _mm512_castsi512_ps(S[2 * k + 1]);
        U[k] = _mm512_add_epi32(_mm512_castps_si512(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0))),
                                _mm512_castps_si512(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1))));
    }
    *first = _mm512_permutex2var_epi32(U[0], _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 16, 24, 17, 25, 18, 26, 19, 27),
                                       U[1]);
    *second = _mm512_permutex2var_epi32(U[0], _mm512_setr_epi32(4, 12, 5, 13, 6, 14, 7, 15, 20, 28, 21, 29, 22, 30, 23,
                                                                 31), U[1]);
}

/* q8_0_scores_avx2's scores, sixteen keys and two blocks at a time: each key's
 * codes (as k + 128, unsigned) against four heads' query codes by vpdpbusd, whose
 * sums start from -128 times the query codes' sum (so they are k . q), folded
 * across keys (fold_keys); then per block, in order, the float arithmetic of the
 * portable q8_0_scores on sixteen keys' lanes: the same bits. */
AVX512VNNI void q8_0_scores_vnni(const uint8_t *const *keys, Py_ssize_t n, const int8_t *q, const float *qd,
                                 Py_ssize_t heads, Py_ssize_t blocks, float *s, Py_ssize_t stride) {
    const __m512i flip = _mm512_set1_epi8((char)0x80), zero = _mm512_setzero_si512();
    __m512i part[4][16];
    for (Py_ssize_t j0 = 0; j0 < n; j0 += 16) {
        const Py_ssize_t m = n - j0 < 16 ? n - j0 : 16;
        for (Py_ssize_t g0 = 0; g0 < heads; g0 += 4) {
            const Py_ssize_t H = heads - g0 < 4 ? heads - g0 : 4;
            __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
            for (Py_ssize_t b = 0; b < blocks; b += 2) {
                const int two = blocks - b >= 2;
                __m512i qv[4], start[4];
                for (Py_ssize_t h = 0; h < H; h++) {
                    const int8_t *qb = q + ((g0 + h) * blocks + b) * 32;
                    qv[h] = two ? _mm512_loadu_si512(qb) : _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)qb));
                    start[h] = _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, flip, qv[h]));
                }
                uint16_t kd[2][16];
                for (Py_ssize_t p = 0; p < 16; p++) {
                    if (p >= m) {
                        kd[0][p] = kd[1][p] = 0;
                        for (Py_ssize_t h = 0; h < H; h++) part[h][p] = zero;
                        continue;
                    }
                    const uint8_t *blk = keys[j0 + p] + b * Q8_0_BYTES;
                    memcpy(&kd[0][p], blk, 2);
                    const __m256i c0 = _mm256_loadu_si256((const __m256i *)(blk + 2));
                    __m512i k = _mm512_zextsi256_si512(c0);
                    if (two) {
                        memcpy(&kd[1][p], blk + Q8_0_BYTES, 2);
                        k = _mm512_inserti64x4(k, _mm256_loadu_si256((const __m256i *)(blk + Q8_0_BYTES + 2)), 1);
                    } else {
                        kd[1][p] = 0;
                    }
                    k = _mm512_xor_si512(k, flip);
                    for (Py_ssize_t h = 0; h < H; h++) part[h][p] = _mm512_dpbusd_epi32(start[h], k, qv[h]);
                }
                const __m512 d0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)kd[0]));
                const __m512 d1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)kd[1]));
                for (Py_ssize_t h = 0; h < H; h++) {
                    __m512i i0, i1;
                    fold_keys(part[h], &i0, &i1);
                    const float *dq = qd + (g0 + h) * blocks + b;
                    acc[h] = _mm512_add_ps(acc[h], _mm512_mul_ps(_mm512_cvtepi32_ps(i0), _mm512_mul_ps(d0, _mm512_set1_ps(dq[0]))));
                    if (two)
                        acc[h] = _mm512_add_ps(acc[h], _mm512_mul_ps(_mm512_cvtepi32_ps(i1),
                                                                     _mm512_mul_ps(d1, _mm512_set1_ps(dq[1]))));
                }
            }
            for (Py_ssize_t h = 0; h < H; h++) {
                if (m == 16) {
                    _mm512_storeu_ps(s + (g0 + h) * stride + j0, acc[h]);
                } else {
                    float r[16];
                    _mm512_storeu_ps(r, acc[h]);
                    for (Py_ssize_t p = 0; p < m; p++) s[(g0 + h) * stride + j0 + p] = r[p];
                }
            }
        }
    }
}

#endif
