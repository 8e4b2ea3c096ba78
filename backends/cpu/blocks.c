/* GGML's blocks as a GGUF file stores them (the block forms: kernels.h).
 *
 * form = FORM_BLOCKS + a GGML type id (ggml.h's enum ggml_type): W's rows are
 * that type's blocks, byte for byte the file's (ggml-common.h's block_q4_0 ...
 * block_q6_K), read where they lie (the pages of the memory-mapped file).
 * Each block is the affine form above, exactly
 * (infer.formats.gguf_quants.affine_groups; d, m, dmin float16):
 *
 *   Q4_0, Q5_0, Q8_0: one group of 32, scale d, bias -2^(b-1) d (4-, 5-, 8-bit codes);
 *   Q4_1, Q5_1: one group of 32, scale d, bias m;
 *   Q4_K: 8 groups of 32 per 256, scale d * sc, bias -(dmin * m) (6-bit sc, m), 4-bit codes;
 *   Q5_K: the same with 5-bit codes (the fifth bits in qh);
 *   Q6_K: 16 groups of 16 per 256, scale d * sc (sc int8), bias -32 * scale, 6-bit codes.
 *
 * (d * sc and dmin * m are exact in float32: an 11-bit float16 times at most
 * 8 bits.) A product decodes a tile of W's rows at a time into that form, in a
 * buffer on the thread's stack that stays in the core's caches, and runs the
 * affine row kernels on it: memory is read for the file's bytes only (Q4_K
 * 4.5 bits a weight, against 6 for 4-bit codes with a float32 scale and bias
 * per 32; Q6_K 6.6 against 10; Q5_0 5.5 against 8.5), and every path computes
 * what it computes on the converted weight, the same codes and scales summed
 * in the same order: the same bits (tests/test_numpy_kernels.py). Decoding is
 * integer work on bytes already read; the float sums are untouched. */

#include "kernels.h"

static inline float f16_at(const uint8_t *p) { return half_to_float((uint16_t)(p[0] | p[1] << 8)); }

/* Q4_K/Q5_K's 8 six-bit scales (sc) and minimums (m) from their 12 bytes,
 * four a word: ggml's get_scale_min_k4 for every j at once (the masks of its
 * x86 kernels). */
static inline void k_sixbits(const uint8_t *b, uint8_t sc[8], uint8_t m[8]) {
    uint32_t u[3], t[4];
    memcpy(u, b + 4, 12);
    t[0] = u[0] & 0x3f3f3f3fu;                                        /* sc 0..3 */
    t[1] = (u[2] & 0x0f0f0f0fu) | ((u[0] >> 2) & 0x30303030u);        /* sc 4..7 */
    t[2] = u[1] & 0x3f3f3f3fu;                                        /* m 0..3 */
    t[3] = ((u[2] >> 4) & 0x0f0f0f0fu) | ((u[1] >> 2) & 0x30303030u); /* m 4..7 */
    memcpy(sc, t, 8);
    memcpy(m, t + 2, 8);
}

/* The scales s and biases bi of one block (1, 8 or 16 groups), as the
 * converted weight holds them: float16 values widened, the K types' products
 * in float32, a symmetric type's bias its factor times the scale (exact). */
static inline void decode_scales(int type, const uint8_t *b, float *s, float *bi) {
    switch (type) {
    case GGML_Q4_0: s[0] = f16_at(b), bi[0] = -8.0f * s[0]; return;
    case GGML_Q5_0: s[0] = f16_at(b), bi[0] = -16.0f * s[0]; return;
    case GGML_Q8_0: s[0] = f16_at(b), bi[0] = -128.0f * s[0]; return;
    case GGML_Q4_1: case GGML_Q5_1: s[0] = f16_at(b), bi[0] = f16_at(b + 2); return;
    case GGML_Q6_K: {
        const int8_t *sc = (const int8_t *)(b + 192);
        const float d = f16_at(b + 208);
        for (int g = 0; g < 16; g++) {
            s[g] = d * (float)sc[g];
            bi[g] = -32.0f * s[g];
        }
        return;
    }
    default: { /* Q4_K, Q5_K */
        uint8_t sc[8], m[8];
        k_sixbits(b, sc, m);
        const float d = f16_at(b), dmin = f16_at(b + 2);
        for (int j = 0; j < 8; j++) {
            s[j] = d * (float)sc[j];
            bi[j] = -(dmin * (float)m[j]);
        }
    }
    }
}

/* The 5-bit codes of a Q5_0/Q5_1 block (qh, the fifth bits as a little-endian
 * u32, then the nibbles: low ones values 0..15, high ones 16..31), one a byte. */
static inline void q5_codes(const uint8_t *qh4, const uint8_t *qs, uint8_t *o) {
    uint32_t qh;
    memcpy(&qh, qh4, 4);
    for (int j = 0; j < 16; j++) {
        o[j] = (uint8_t)((qs[j] & 15) | (((qh >> j) & 1) << 4));
        o[j + 16] = (uint8_t)((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4));
    }
}

/* The codes of one block as the converted weight holds them (4-bit: GGML's
 * per-group order, 16 bytes a group, which Q4_0's and Q4_1's blocks already
 * are; 8-bit: one a byte in column order). */
static inline void decode_codes(int type, const uint8_t *b, uint8_t *codes) {
    switch (type) {
    case GGML_Q4_0: memcpy(codes, b + 2, 16); return;
    case GGML_Q4_1: memcpy(codes, b + 4, 16); return;
    case GGML_Q5_0: q5_codes(b + 2, b + 6, codes); return;
    case GGML_Q5_1: q5_codes(b + 4, b + 8, codes); return;
    case GGML_Q8_0:
        for (int j = 0; j < 32; j++) codes[j] = b[2 + j] ^ 0x80; /* int8 q -> q + 128 */
        return;
    case GGML_Q4_K:
        /* 4 chunks of 32 bytes: low nibbles are group 2i (column j at byte j),
         * high nibbles group 2i + 1; GGML's order puts columns j and j + 16 in byte j. */
        for (int i = 0; i < 4; i++) {
            const uint8_t *q = b + 16 + 32 * i;
            uint8_t *lo = codes + 32 * i, *hi = lo + 16;
            for (int j = 0; j < 16; j++) {
                lo[j] = (uint8_t)((q[j] & 15) | (q[j + 16] << 4));
                hi[j] = (uint8_t)((q[j] >> 4) | (q[j + 16] & 0xF0));
            }
        }
        return;
    case GGML_Q5_K: {
        const uint8_t *qh = b + 16;
        for (int i = 0; i < 4; i++) {
            const uint8_t *q = b + 48 + 32 * i;
            uint8_t *lo = codes + 64 * i, *hi = lo + 32;
            for (int j = 0; j < 32; j++) {
                lo[j] = (uint8_t)((q[j] & 15) | (((qh[j] >> (2 * i)) & 1) << 4));
                hi[j] = (uint8_t)((q[j] >> 4) | (((qh[j] >> (2 * i + 1)) & 1) << 4));
            }
        }
        return;
    }
    default: /* Q6_K: two halves of 128 values; ql's nibbles and qh's 2-bit fields, 32 values at a time */
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
            uint8_t *o = codes + 128 * h;
            for (int l = 0; l < 32; l++) {
                o[l] = (uint8_t)((ql[l] & 15) | ((qh[l] & 3) << 4));
                o[l + 32] = (uint8_t)((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4));
                o[l + 64] = (uint8_t)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
                o[l + 96] = (uint8_t)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4));
            }
        }
    }
}

static void decode_row(int type, const uint8_t *raw, Py_ssize_t blocks, Py_ssize_t block_bytes, Py_ssize_t code_bytes,
                       Py_ssize_t per, uint8_t *codes, float *s, float *bi) {
    for (Py_ssize_t j = 0; j < blocks; j++) {
        decode_codes(type, raw + j * block_bytes, codes + j * code_bytes);
        decode_scales(type, raw + j * block_bytes, s + j * per, bi + j * per);
    }
}

/* Rows [0, rows) of block-form W (raw_row bytes apart, from raw) decoded:
 * codes row_bytes apart, scales and biases groups apart; the raw bytes up to
 * `left` past raw are asked for PREFETCH ahead (the hardware prefetchers stop
 * at 4 KiB pages). */
void decode_tile(int type, const uint8_t *raw, Py_ssize_t raw_row, Py_ssize_t rows, Py_ssize_t k,
                 Py_ssize_t left, uint8_t *codes, float *s, float *bi) {
    int bits = 8;
    Py_ssize_t group = GROUP, values = GROUP, block_bytes = 0;
    block_form(FORM_BLOCKS + type, &bits, &group, &values, &block_bytes);
    const Py_ssize_t blocks = k / values, code_bytes = bits == 4 ? values / 2 : values, per = values / group;
    for (Py_ssize_t r = 0; r < rows; r++) {
        for (Py_ssize_t b = 0; b < raw_row && r * raw_row + PREFETCH + b < left; b += 64)
            __builtin_prefetch((const char *)raw + r * raw_row + PREFETCH + b, 0, PREFETCH_LOCALITY);
        const uint8_t *row = raw + r * raw_row;
        uint8_t *c = codes + r * blocks * code_bytes;
        float *sr = s + r * blocks * per, *br = bi + r * blocks * per;
#ifdef HAVE_X86
        if (use_avx2) {
            decode_row_avx2(type, row, blocks, block_bytes, code_bytes, per, c, sr, br);
            continue;
        }
#endif
        decode_row(type, row, blocks, block_bytes, code_bytes, per, c, sr, br);
    }
}
