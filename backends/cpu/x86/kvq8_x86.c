/* attention.c's q8_0 scores on AVX2: per block, vpsignb/vpabsb then vpmaddubsw
 * and vpmaddwd (ggml's form for q8_0 dot products), the eight int32 lanes summed
 * exactly, four query heads at once; then the same float arithmetic as the
 * portable q8_0_scores, in the same order, so the bits are the same. */

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

#endif
