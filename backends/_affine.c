/* Matrix-vector products on affine-quantized weights for the numpy backend.
 *
 * A weight W [n, k] is held as codes (4 bits, two per byte in GGML's order:
 * in each group of 32 columns, byte j holds column j in its low nibble and
 * column j + 16 in its high one; or 8 bits, one per byte) with a float32
 * scale and bias per group of 32 consecutive values of a row:
 *
 *     W[r, c] = scale[r, g] * code[r, c] + bias[r, g],    g = c / 32
 *
 * (infer.quantize.AffineTensor; every GGUF type with a group-of-32 affine form
 * maps onto it exactly, and Q6_K onto 8-bit codes with groups of 16). For
 * activations x [m, k] this computes y = x @ W.T as
 *
 *     y[i, r] = sum_g scale[r, g] * sum_{c in g} code[r, c] * x[i, c]
 *             + sum_g bias[r, g] * sum_{c in g} x[i, c]
 *
 * in float32: the codes are read once per call (about a quarter of float32's
 * bytes for 4 bits), which is what bounds decoding. The result differs from
 * dequantize-then-BLAS only in the order of float32 additions.
 *
 * Symmetric types (GGUF's Q4_0, Q5_0, Q8_0, Q6_K: value = scale * (q - 2^(b-1)))
 * may leave the biases out: each is then factor * its scale (factor = -2^(b-1),
 * a power of two, so the product is exact), made per tile of rows from the
 * scales, and the bytes of the biases are neither held nor read.
 *
 * Scales and biases are float32, or float16 where every one of them is a
 * float16 value (GGUF's Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 store them so): each
 * row's are then widened to float32 before its sums, so the arithmetic, and
 * the result, are the same as with float32 ones, for fewer bytes read.
 *
 * GGML's blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) are also taken
 * as a GGUF file stores them, and decoded into this form a tile of rows at a
 * time (see "GGML's blocks as a GGUF file stores them" below).
 *
 * Also: dequantization into a caller's float32 buffer (for products with many
 * rows, where BLAS on the dequantized matrix is faster).
 *
 * The code path is chosen at run time (__builtin_cpu_supports): AVX-512 (F, BW, VL) where
 * the CPU has it (the products only), else AVX2+FMA+F16C, else the portable
 * loops; use_simd() forces a lesser one (INFER_NUMPY_KERNELS, the tests). Rows
 * of W are split across OpenMP threads when built with OpenMP. The GIL is
 * released while computing.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HAVE_X86 1
#include <immintrin.h>
#endif

#define GROUP 32    /* columns per block of codes; a block has one scale, or two (groups of 16) */
#define MAX_ROWS 8  /* activation rows handled together; more go in chunks */
#define TILE_GROUPS 8192  /* float16 scales are widened a tile of rows at a time, on the stack */
#define TILE_ROWS 32
#ifndef PREFETCH
#define PREFETCH 4096
#endif
/* The weights' bytes are asked for into every cache level (prefetcht0): with
 * the non-temporal hint (locality 0) a 1B-class model's 113 decoding products
 * took a third longer while other work contended for the memory, and the same
 * time on a quiet machine (docs/performance.md, "Prefetching"). */
#ifndef PREFETCH_LOCALITY
#define PREFETCH_LOCALITY 3
#endif

static void group_sums(const float *x, float *xs, Py_ssize_t m, Py_ssize_t k, Py_ssize_t group) {
    Py_ssize_t groups = k / group;
    for (Py_ssize_t i = 0; i < m; i++)
        for (Py_ssize_t g = 0; g < groups; g++) {
            float s = 0.0f;
            for (Py_ssize_t j = 0; j < group; j++) s += x[i * k + g * group + j];
            xs[i * groups + g] = s;
        }
}

/* IEEE half to float, exactly (subnormals, infinities and NaNs included). */
static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man) { /* subnormal: shift the mantissa up to a leading one */
        uint32_t e = 113;
        while (!(man & 0x400u)) {
            man <<= 1;
            e--;
        }
        bits = sign | (e << 23) | ((man & 0x3ffu) << 13);
    } else {
        bits = sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Float to IEEE half, rounded to nearest, ties to even, as numpy's
 * astype(float16): beyond the largest half an infinity, below half the
 * smallest subnormal a zero, subnormals rounded alike, a NaN kept a NaN. */
static uint16_t float_to_half(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) { /* infinity, or NaN with its top mantissa bits (never all zero) */
        const uint32_t m = (ax & 0x7fffffu) >> 13;
        return (uint16_t)(sign | 0x7c00u | (ax == 0x7f800000u ? 0 : (m ? m : 1)));
    }
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* 65520 and up round past 65504 */
    uint32_t h, rest, halfway;
    if (ax >= 0x38800000u) { /* a normal half: drop 13 mantissa bits */
        h = (((ax >> 23) - 112) << 10) | ((ax & 0x7fffffu) >> 13);
        rest = ax & 0x1fffu;
        halfway = 0x1000u;
    } else if (ax > 0x33000000u) { /* a subnormal half: units of 2^-24 */
        const uint32_t shift = 126 - (ax >> 23), m = (ax & 0x7fffffu) | 0x800000u;
        h = m >> shift;
        rest = m & ((1u << shift) - 1);
        halfway = 1u << (shift - 1);
    } else {
        return (uint16_t)sign; /* at most 2^-25: ties to the even zero */
    }
    if (rest > halfway || (rest == halfway && (h & 1))) h++; /* a carry moves into the exponent, as it should */
    return (uint16_t)(sign | h);
}

/* -- portable ----------------------------------------------------------------- */

static void row4_portable(const uint8_t *codes, const float *scales, const float *biases, const float *x,
                          const float *xs, float *out, Py_ssize_t m, Py_ssize_t k, Py_ssize_t n, Py_ssize_t group) {
    (void)group; /* always 32 */
    Py_ssize_t groups = k / GROUP;
    for (Py_ssize_t i = 0; i < m; i++) {
        float acc = 0.0f, bacc = 0.0f;
        for (Py_ssize_t g = 0; g < groups; g++) {
            const uint8_t *b = codes + g * (GROUP / 2);
            const float *v = x + i * k + g * GROUP;
            float t = 0.0f;
            for (int j = 0; j < GROUP / 2; j++) t += (float)(b[j] & 15) * v[j] + (float)(b[j] >> 4) * v[j + GROUP / 2];
            acc += scales[g] * t;
            bacc += biases[g] * xs[i * groups + g];
        }
        out[i * n] = acc + bacc;
    }
}

static void row8_portable(const uint8_t *codes, const float *scales, const float *biases, const float *x,
                          const float *xs, float *out, Py_ssize_t m, Py_ssize_t k, Py_ssize_t n, Py_ssize_t group) {
    Py_ssize_t groups = k / group;
    for (Py_ssize_t i = 0; i < m; i++) {
        float acc = 0.0f, bacc = 0.0f;
        for (Py_ssize_t g = 0; g < groups; g++) {
            const uint8_t *b = codes + g * group;
            const float *v = x + i * k + g * group;
            float t = 0.0f;
            for (Py_ssize_t j = 0; j < group; j++) t += (float)b[j] * v[j];
            acc += scales[g] * t;
            bacc += biases[g] * xs[i * groups + g];
        }
        out[i * n] = acc + bacc;
    }
}

static void rowf_portable(const float *w, const float *x, float *out, Py_ssize_t m, Py_ssize_t k, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < m; i++) {
        float acc = 0.0f;
        for (Py_ssize_t c = 0; c < k; c++) acc += w[c] * x[i * k + c];
        out[i * n] = acc;
    }
}

/* -- AVX2 + FMA ----------------------------------------------------------------- */

#ifdef HAVE_X86
#define AVX2 __attribute__((target("avx2,fma,f16c")))

AVX2 static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

AVX2 static inline __m256 widen(__m128i bytes8) { /* the low 8 bytes as 8 floats */
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes8));
}

#define INLINE static inline __attribute__((always_inline))

/* One block of 32 4-bit codes (16 bytes: the low nibbles are columns 0..15,
 * the high ones 16..31) as four vectors of 8 floats in column order: x is
 * read in its own order. */
AVX2 INLINE void nibbles32(const uint8_t *c, __m256 *w) {
    const __m128i low = _mm_set1_epi8(15);
    __m128i v = _mm_loadu_si128((const __m128i *)c);
    __m128i lo = _mm_and_si128(v, low), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low);
    w[0] = widen(lo), w[1] = widen(_mm_srli_si128(lo, 8)), w[2] = widen(hi), w[3] = widen(_mm_srli_si128(hi, 8));
}

/* One activation row: two accumulators in registers, two groups per step
 * (the accumulator chain, not the loads, limits the loop otherwise). */
AVX2 static inline __m256 dot4(const uint8_t *codes, const float *v) {
    __m256 w[4];
    nibbles32(codes, w);
    __m256 t = _mm256_mul_ps(w[0], _mm256_loadu_ps(v));
    t = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(v + 8), t);
    t = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(v + 16), t);
    return _mm256_fmadd_ps(w[3], _mm256_loadu_ps(v + 24), t);
}

/* 8 codes at p as 8 floats: the 8 bytes broadcast to both 128-bit lanes, then an
 * in-lane byte shuffle to 32-bit lanes (vpmovzxbd crosses lanes, slower on some CPUs). */
AVX2 static inline __m256 widen8(const uint8_t *p) {
    const __m256i pick = _mm256_setr_epi8(0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1, -1,
                                          4, -1, -1, -1, 5, -1, -1, -1, 6, -1, -1, -1, 7, -1, -1, -1);
    int64_t q;
    memcpy(&q, p, 8);
    return _mm256_cvtepi32_ps(_mm256_shuffle_epi8(_mm256_set1_epi64x(q), pick));
}

AVX2 static inline __m256 dot8(const uint8_t *c, const float *v) {
    __m256 t = _mm256_mul_ps(widen8(c), _mm256_loadu_ps(v));
    t = _mm256_fmadd_ps(widen8(c + 8), _mm256_loadu_ps(v + 8), t);
    t = _mm256_fmadd_ps(widen8(c + 16), _mm256_loadu_ps(v + 16), t);
    return _mm256_fmadd_ps(widen8(c + 24), _mm256_loadu_ps(v + 24), t);
}

/* 8-bit codes with a scale per 16 columns: one block of 32, scales s[0], s[1]. */
AVX2 static inline __m256 g16_step(const uint8_t *c, const float *v, const float *s, __m256 acc) {
    __m256 t = _mm256_mul_ps(widen8(c), _mm256_loadu_ps(v));
    t = _mm256_fmadd_ps(widen8(c + 8), _mm256_loadu_ps(v + 8), t);
    __m256 u = _mm256_mul_ps(widen8(c + 16), _mm256_loadu_ps(v + 16));
    u = _mm256_fmadd_ps(widen8(c + 24), _mm256_loadu_ps(v + 24), u);
    return _mm256_fmadd_ps(_mm256_broadcast_ss(s + 1), u, _mm256_fmadd_ps(_mm256_broadcast_ss(s), t, acc));
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

AVX2 static float one_row(int bits, const uint8_t *codes, const float *scales, const float *biases, const float *v,
                          const float *xs, Py_ssize_t k, Py_ssize_t group) {
    Py_ssize_t groups = k / GROUP, step = bits == 4 ? GROUP / 2 : GROUP, g = 0;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    if (group == 16) { /* groups here are blocks of 32 columns, two scales each */
        for (; g + 1 < groups; g += 2) {
            a0 = g16_step(codes + g * GROUP, v + g * GROUP, scales + 2 * g, a0);
            a1 = g16_step(codes + (g + 1) * GROUP, v + (g + 1) * GROUP, scales + 2 * (g + 1), a1);
        }
        if (g < groups) a0 = g16_step(codes + g * GROUP, v + g * GROUP, scales + 2 * g, a0);
        return hsum(_mm256_add_ps(a0, a1)) + bias_dot(biases, xs, 2 * groups);
    }
    if (bits == 4) {
        for (; g + 1 < groups; g += 2) {
            a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(scales + g), dot4(codes + g * step, v + g * GROUP), a0);
            a1 = _mm256_fmadd_ps(_mm256_broadcast_ss(scales + g + 1), dot4(codes + (g + 1) * step, v + (g + 1) * GROUP), a1);
        }
        if (g < groups) a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(scales + g), dot4(codes + g * step, v + g * GROUP), a0);
    } else {
        for (; g + 1 < groups; g += 2) {
            a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(scales + g), dot8(codes + g * step, v + g * GROUP), a0);
            a1 = _mm256_fmadd_ps(_mm256_broadcast_ss(scales + g + 1), dot8(codes + (g + 1) * step, v + (g + 1) * GROUP), a1);
        }
        if (g < groups) a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(scales + g), dot8(codes + g * step, v + g * GROUP), a0);
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

/* The same for 8-bit codes with a scale per 16 columns (g16_step's order). */
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
    if (bits == 4) {
        nibbles32(codes + g * (GROUP / 2), w);
    } else {
        const uint8_t *c = codes + g * GROUP;
        w[0] = widen8(c), w[1] = widen8(c + 8), w[2] = widen8(c + 16), w[3] = widen8(c + 24);
    }
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

AVX2 INLINE void rows_avx2(int bits, const uint8_t *codes, const float *scales, const float *biases, const float *x,
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

#define ROWS_CASES(call) \
    switch (m) { \
    case 2: call(2); break; case 3: call(3); break; case 4: call(4); break; \
    case 5: call(5); break; case 6: call(6); break; case 7: call(7); break; default: call(8); break; \
    }

AVX2 static void row4_avx2(const uint8_t *codes, const float *scales, const float *biases, const float *x,
                           const float *xs, float *out, Py_ssize_t m, Py_ssize_t k, Py_ssize_t n, Py_ssize_t group) {
    if (m == 1) {
        out[0] = one_row(4, codes, scales, biases, x, xs, k, group);
        return;
    }
#define CALL_ROWS4(M) rows_avx2(4, codes, scales, biases, x, xs, out, k, n, group, M)
    ROWS_CASES(CALL_ROWS4)
}

AVX2 static void row8_avx2(const uint8_t *codes, const float *scales, const float *biases, const float *x,
                           const float *xs, float *out, Py_ssize_t m, Py_ssize_t k, Py_ssize_t n, Py_ssize_t group) {
    if (m == 1) {
        out[0] = one_row(8, codes, scales, biases, x, xs, k, group);
        return;
    }
#define CALL_ROWS8(M) rows_avx2(8, codes, scales, biases, x, xs, out, k, n, group, M)
    ROWS_CASES(CALL_ROWS8)
}

AVX2 static void rowf_avx2(const float *w, const float *x, float *out, Py_ssize_t m, Py_ssize_t k, Py_ssize_t n) {
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

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#define WROWS 4 /* short 4-bit weight rows per step when decoding */
#define WIDE_ROW_BYTES 384 /* 4-bit rows up to 768 columns */

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
AVX512 static void tile_512(int bits, Py_ssize_t group, int wr, const uint8_t *codes, const float *s, const float *bi,
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

AVX512 static void row4_avx512(const uint8_t *codes, const float *scales, const float *biases, const float *x,
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

AVX512 static void row8_avx512(const uint8_t *codes, const float *scales, const float *biases, const float *x,
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

/* One row of codes to float32, group by group (columns 0..15 of a 4-bit group in the low nibbles). */
AVX2 static void dequant_row_avx2(int bits, const uint8_t *codes, const float *scales, const float *biases,
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
#endif

typedef void (*row_fn)(const uint8_t *, const float *, const float *, const float *, const float *, float *,
                       Py_ssize_t, Py_ssize_t, Py_ssize_t, Py_ssize_t);

/* n float16 values to float32 (F16C on the AVX2 path). */
#ifdef HAVE_X86
AVX2 static void halves_f16c(const uint16_t *h, float *f, Py_ssize_t n) {
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(f + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
    for (; i < n; i++) f[i] = half_to_float(h[i]);
}
#endif

#ifdef HAVE_X86
/* The same, sixteen at a time (AVX-512F's vcvtph2ps). */
AVX512 static void halves_512(const uint16_t *h, float *f, Py_ssize_t n) {
    Py_ssize_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(f + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + i))));
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(f + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
    for (; i < n; i++) f[i] = half_to_float(h[i]);
}
#endif

/* The code path: portable C loops, AVX2+FMA+F16C, or AVX-512 F+BW+VL (on top of AVX2,
 * which its elementwise ops, attention and dequantization keep using). */
static int use_avx2 = 0, use_avx512 = 0;

/* -- Python ------------------------------------------------------------------- */

static int check(Py_buffer *b, Py_ssize_t want, const char *what) {
    if (b->len != want) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes, expected %zd", what, b->len, want);
        return 0;
    }
    return 1;
}

static void halves(const uint16_t *h, float *f, Py_ssize_t n) {
#ifdef HAVE_X86
    if (use_avx512) {
        halves_512(h, f, n);
        return;
    }
    if (use_avx2) {
        halves_f16c(h, f, n);
        return;
    }
#endif
    for (Py_ssize_t i = 0; i < n; i++) f[i] = half_to_float(h[i]);
}

/* `obj` as a buffer in *b (PyBUF_SIMPLE, or PyBUF_WRITABLE), or b->obj NULL for
 * None; 0 (an exception set) when neither. */
static int optional_buffer(PyObject *obj, Py_buffer *b, int flags) {
    b->obj = NULL;
    b->buf = NULL;
    return obj == Py_None || PyObject_GetBuffer(obj, b, flags) == 0;
}

/* check() for a buffer that may be absent (b->obj NULL: nothing to check). */
static int optional_check(Py_buffer *b, Py_ssize_t want, const char *what) {
    return !b->obj || check(b, want, what);
}

static void release_optional(Py_buffer *b) {
    if (b->obj) PyBuffer_Release(b);
}

/* -- GGML's blocks as a GGUF file stores them -----------------------------------
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

#define FORM_BLOCKS 256
#define QK_K 256
#define DECODED_BYTES 32768 /* decoded codes of a tile of rows, on the stack (with `wide`, in L2) */
#define DIRECT_ROWS 1 /* rows of x up to which blocks are decoded in registers: past it, once a tile for all rows (faster for 2 and up) */

enum {
    GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q5_0 = 6, GGML_Q5_1 = 7, GGML_Q8_0 = 8,
    GGML_Q4_K = 12, GGML_Q5_K = 13, GGML_Q6_K = 14
};

/* What a block form decodes to: code bits (4, or 8 for one per byte), the
 * group, and the values and bytes of one block. 0 for a form that is not one. */
static int block_form(int form, int *bits, Py_ssize_t *group, Py_ssize_t *values, Py_ssize_t *bytes) {
    int b;
    Py_ssize_t g = 32, v = 32, n;
    switch (form - FORM_BLOCKS) {
    case GGML_Q4_0: b = 4, n = 18; break;
    case GGML_Q4_1: b = 4, n = 20; break;
    case GGML_Q5_0: b = 8, n = 22; break;
    case GGML_Q5_1: b = 8, n = 24; break;
    case GGML_Q8_0: b = 8, n = 34; break;
    case GGML_Q4_K: b = 4, v = QK_K, n = 144; break;
    case GGML_Q5_K: b = 8, v = QK_K, n = 176; break;
    case GGML_Q6_K: b = 8, g = 16, v = QK_K, n = 210; break;
    default: return 0;
    }
    *bits = b, *group = g, *values = v, *bytes = n;
    return 1;
}

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

#ifdef HAVE_X86
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

AVX2 INLINE void q5_codes_avx2(const uint8_t *qh4, const uint8_t *qs, uint8_t *o) {
    _mm256_storeu_si256((__m256i *)o, q5_vector(qh4, qs));
}

/* decode_codes, 16 or 32 bytes at a time (the same bytes). */
AVX2 INLINE void decode_codes_avx2(int type, const uint8_t *b, uint8_t *codes) {
    switch (type) {
    case GGML_Q4_0: case GGML_Q4_1: decode_codes(type, b, codes); return; /* a copy */
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

/* decode_scales, eight at a time where a block has 8 or 16 groups (the same float32 products). */
AVX2 INLINE void decode_scales_avx2(int type, const uint8_t *b, float *s, float *bi) {
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
        _mm256_storeu_ps(s, _mm256_mul_ps(d, fs));
        _mm256_storeu_ps(bi, _mm256_xor_ps(_mm256_mul_ps(dmin, fm), _mm256_set1_ps(-0.0f))); /* -(dmin * m) */
    } else if (type == GGML_Q6_K) {
        const __m256 d = _mm256_set1_ps(_cvtsh_ss((uint16_t)(b[208] | b[209] << 8))), f = _mm256_set1_ps(-32.0f);
        __m128i sc = _mm_loadu_si128((const __m128i *)(b + 192));
        __m256 s0 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
        __m256 s1 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))));
        _mm256_storeu_ps(s, s0);
        _mm256_storeu_ps(s + 8, s1);
        _mm256_storeu_ps(bi, _mm256_mul_ps(f, s0));
        _mm256_storeu_ps(bi + 8, _mm256_mul_ps(f, s1));
    } else {
        decode_scales(type, b, s, bi); /* one float16 (or two) per block; half_to_float is exact, as F16C is */
    }
}

AVX2 static void decode_row_avx2(int type, const uint8_t *raw, Py_ssize_t blocks, Py_ssize_t block_bytes,
                                 Py_ssize_t code_bytes, Py_ssize_t per, uint8_t *codes, float *s, float *bi) {
    for (Py_ssize_t j = 0; j < blocks; j++) {
        decode_codes_avx2(type, raw + j * block_bytes, codes + j * code_bytes);
        decode_scales_avx2(type, raw + j * block_bytes, s + j * per, bi + j * per);
    }
}
#endif

#ifdef HAVE_X86
/* One activation row against one weight row of blocks, on AVX-512, decoding
 * in registers (no tile buffer): for decoding, where the tile's stores and
 * reloads cost more than the bytes they save. The arithmetic is wrows_512's
 * (R = 1) on the decoded form, step for step: per block of 32 columns
 * fold_512 of its columns 0..15 and 16..31 (the 4-bit ones through the same
 * table, the 8-bit ones widened alike), even blocks into one accumulator and
 * odd ones into the other; then bias_dot's sum, 8 groups at a time in order
 * and the last ones one by one. So the bits are wrows_512's. */
/* The 32-value types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): bytes a block, a block's
 * 32 codes a byte each in column order (a 4-bit block's low nibbles are its
 * columns 0..15, the high ones 16..31: as floats, the values the 4-bit
 * kernels' table gives), and the scales and biases of 8 consecutive blocks
 * (decode_scales' values: float16 widened, a symmetric bias its factor times
 * the scale). */
static inline Py_ssize_t small_bytes(int type) {
    return type == GGML_Q4_0 ? 18 : type == GGML_Q4_1 ? 20 : type == GGML_Q5_0 ? 22 : type == GGML_Q5_1 ? 24 : 34;
}
/* A symmetric 32-value type's bias over its scale (Q4_0, Q5_0, Q8_0: decode_scales' factors). */
static inline float small_factor(int type) { return type == GGML_Q4_0 ? -8.0f : type == GGML_Q5_0 ? -16.0f : -128.0f; }

AVX2 INLINE __m256i small_codes(int type, const uint8_t *b) {
    if (type == GGML_Q8_0) /* int8 q -> q + 128 */
        return _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(b + 2)), _mm256_set1_epi8((char)0x80));
    if (type == GGML_Q4_0 || type == GGML_Q4_1) {
        const __m128i q = _mm_loadu_si128((const __m128i *)(b + (type == GGML_Q4_0 ? 2 : 4))), m4 = _mm_set1_epi8(15);
        return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m4), _mm_and_si128(q, m4));
    }
    return type == GGML_Q5_0 ? q5_vector(b + 2, b + 6) : q5_vector(b + 4, b + 8);
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

/* decode_scales for one 32-value block with F16C (exact, as half_to_float is). */
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

AVX512 INLINE float blocks_row_512(const int type, const uint8_t *raw, const float *x, const float *xs, Py_ssize_t k) {
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

/* One row of a K type's blocks against one activation row on AVX2, decoding
 * in registers: one_row's arithmetic (dot4 / dot8 / g16_step per block of 32
 * columns, scaled into the even or odd accumulator, then bias_dot's sum) on
 * the same codes and scales, so the bits are one_row's. */
AVX2 INLINE __m256 widen_q(__m128i v, const int half) { /* bytes 0..7 (half 0) or 8..15 as 8 floats */
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(half ? _mm_srli_si128(v, 8) : v));
}

/* 32 code bytes (column order) against x's 32 columns: dot8's sum (g16: g16_step's two halves, t and u). */
AVX2 INLINE __m256 dot32_avx2(__m256i c, const float *v, __m256 *u) {
    __m128i a = _mm256_castsi256_si128(c), b = _mm256_extracti128_si256(c, 1);
    __m256 t = _mm256_mul_ps(widen_q(a, 0), _mm256_loadu_ps(v));
    t = _mm256_fmadd_ps(widen_q(a, 1), _mm256_loadu_ps(v + 8), t);
    if (u) {
        __m256 h = _mm256_mul_ps(widen_q(b, 0), _mm256_loadu_ps(v + 16));
        *u = _mm256_fmadd_ps(widen_q(b, 1), _mm256_loadu_ps(v + 24), h);
        return t;
    }
    t = _mm256_fmadd_ps(widen_q(b, 0), _mm256_loadu_ps(v + 16), t);
    return _mm256_fmadd_ps(widen_q(b, 1), _mm256_loadu_ps(v + 24), t);
}

AVX2 INLINE float blocks_row_avx2(const int type, const uint8_t *raw, const float *x, const float *xs, Py_ssize_t k) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), bacc = _mm256_setzero_ps();
    float s[16], bi[16];
    if (type != GGML_Q4_K && type != GGML_Q5_K && type != GGML_Q6_K) { /* one_row's blocks of 32, dot8 (= dot4) each */
        const Py_ssize_t bytes = small_bytes(type), blocks = k / GROUP;
        Py_ssize_t g = 0;
        for (; g + 8 <= blocks; g += 8) {
            const uint8_t *b = raw + g * bytes;
            __m256 bv, sv = small_scales(type, b, bytes, &bv);
            _mm256_storeu_ps(s, sv);
            bacc = _mm256_fmadd_ps(bv, _mm256_loadu_ps(xs + g), bacc);
            for (int j = 0; j < 8; j += 2) {
                const float *w = x + (g + j) * GROUP;
                a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(s + j), dot32_avx2(small_codes(type, b + j * bytes), w, NULL), a0);
                a1 = _mm256_fmadd_ps(_mm256_broadcast_ss(s + j + 1),
                                     dot32_avx2(small_codes(type, b + (j + 1) * bytes), w + 32, NULL), a1);
            }
        }
        const Py_ssize_t from = g;
        for (; g < blocks; g++) { /* one_row's last blocks (into a0, as even ones), bias_dot's tail */
            const uint8_t *b = raw + g * bytes;
            small_scale(type, b, s + (g - from), bi + (g - from));
            __m256 d = dot32_avx2(small_codes(type, b), x + g * GROUP, NULL);
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
        const float *v = x + j * QK_K;
        decode_scales_avx2(type, b, s, bi);
        bacc = _mm256_fmadd_ps(_mm256_loadu_ps(bi), _mm256_loadu_ps(xs + j * per), bacc);
        if (per == 16) bacc = _mm256_fmadd_ps(_mm256_loadu_ps(bi + 8), _mm256_loadu_ps(xs + j * per + 8), bacc);
        if (type == GGML_Q4_K) {
            const __m128i m4 = _mm_set1_epi8(15);
            for (int i = 0; i < 4; i++) { /* chunk i: group 2i the low nibbles, 2i + 1 the high ones */
                __m128i qa = _mm_loadu_si128((const __m128i *)(b + 16 + 32 * i));
                __m128i qb = _mm_loadu_si128((const __m128i *)(b + 32 + 32 * i));
                const float *w = v + 64 * i;
                __m128i la = _mm_and_si128(qa, m4), lb = _mm_and_si128(qb, m4);
                __m128i ha = _mm_and_si128(_mm_srli_epi16(qa, 4), m4), hb = _mm_and_si128(_mm_srli_epi16(qb, 4), m4);
                __m256 t = _mm256_mul_ps(widen_q(la, 0), _mm256_loadu_ps(w));
                t = _mm256_fmadd_ps(widen_q(la, 1), _mm256_loadu_ps(w + 8), t);
                t = _mm256_fmadd_ps(widen_q(lb, 0), _mm256_loadu_ps(w + 16), t);
                t = _mm256_fmadd_ps(widen_q(lb, 1), _mm256_loadu_ps(w + 24), t);
                a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(s + 2 * i), t, a0);
                t = _mm256_mul_ps(widen_q(ha, 0), _mm256_loadu_ps(w + 32));
                t = _mm256_fmadd_ps(widen_q(ha, 1), _mm256_loadu_ps(w + 40), t);
                t = _mm256_fmadd_ps(widen_q(hb, 0), _mm256_loadu_ps(w + 48), t);
                t = _mm256_fmadd_ps(widen_q(hb, 1), _mm256_loadu_ps(w + 56), t);
                a1 = _mm256_fmadd_ps(_mm256_broadcast_ss(s + 2 * i + 1), t, a1);
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
                a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(s + 2 * i), dot32_avx2(lo, v + 64 * i, NULL), a0);
                a1 = _mm256_fmadd_ps(_mm256_broadcast_ss(s + 2 * i + 1), dot32_avx2(hi, v + 64 * i + 32, NULL), a1);
            }
        } else { /* Q6_K: g16_step per block of 32 */
            const __m256i m4 = _mm256_set1_epi8(15), m30 = _mm256_set1_epi8(0x30);
            for (int h = 0; h < 2; h++) {
                const uint8_t *ql = b + 64 * h;
                __m256i l0 = _mm256_loadu_si256((const __m256i *)ql), l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
                __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
                __m256i c[4] = {
                    _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30)),
                    _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30)),
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(qh, m30)),
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                    _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30))};
                for (int q = 0; q < 4; q += 2) {
                    const float *sq = s + 8 * h + 2 * q, *w = v + 128 * h + 32 * q;
                    __m256 u, t = dot32_avx2(c[q], w, &u);
                    a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(sq + 1), u, _mm256_fmadd_ps(_mm256_broadcast_ss(sq), t, a0));
                    t = dot32_avx2(c[q + 1], w + 32, &u);
                    a1 = _mm256_fmadd_ps(_mm256_broadcast_ss(sq + 3), u, _mm256_fmadd_ps(_mm256_broadcast_ss(sq + 2), t, a1));
                }
            }
        }
    }
    return hsum(_mm256_add_ps(a0, a1)) + hsum(bacc);
}

/* Whether blocks_row_512 and blocks_row_avx2 compute this type (all eight block forms). */
static int direct_512(int type) {
    return type == GGML_Q4_0 || type == GGML_Q4_1 || type == GGML_Q4_K || type == GGML_Q5_K || type == GGML_Q6_K ||
           type == GGML_Q5_0 || type == GGML_Q5_1 || type == GGML_Q8_0;
}
static int direct_avx2(int type) { return direct_512(type); }

#define BLOCK_ROW_CASES(fn) \
    switch (type) { \
    case GGML_Q4_K: v = fn(GGML_Q4_K, row, xi, xsi, k); break; \
    case GGML_Q5_K: v = fn(GGML_Q5_K, row, xi, xsi, k); break; \
    case GGML_Q6_K: v = fn(GGML_Q6_K, row, xi, xsi, k); break; \
    case GGML_Q5_0: v = fn(GGML_Q5_0, row, xi, xsi, k); break; \
    case GGML_Q5_1: v = fn(GGML_Q5_1, row, xi, xsi, k); break; \
    case GGML_Q4_0: v = fn(GGML_Q4_0, row, xi, xsi, k); break; \
    case GGML_Q4_1: v = fn(GGML_Q4_1, row, xi, xsi, k); break; \
    default: v = fn(GGML_Q8_0, row, xi, xsi, k); break; \
    }

/* Rows [r0, r1) of block-form W against m activation rows (x [m, k], their
 * group sums xs `groups` apart, y [m, n]), a row of W and of x at a time: each
 * row's sums are those it gets alone, and a weight row stays in L1 for the m
 * rows that read it. The blocks are asked for PREFETCH bytes ahead (up to
 * `left` bytes past raw). wide: the AVX-512 kernel, else AVX2's. */
AVX512 static void blocks_rows_512(int type, const uint8_t *raw, Py_ssize_t raw_row, Py_ssize_t r0, Py_ssize_t r1,
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
    for (Py_ssize_t r = r0; r < r1; r++) {
        const char *at = (const char *)raw + r * raw_row;
        for (Py_ssize_t b = 0; b < raw_row && r * raw_row + PREFETCH + b < left; b += 64)
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

AVX2 static void blocks_rows_avx2(int type, const uint8_t *raw, Py_ssize_t raw_row, Py_ssize_t r0, Py_ssize_t r1,
                                  Py_ssize_t left, const float *x, const float *xs, float *y, Py_ssize_t m,
                                  Py_ssize_t k, Py_ssize_t n, Py_ssize_t groups) {
    for (Py_ssize_t r = r0; r < r1; r++) {
        const char *at = (const char *)raw + r * raw_row;
        for (Py_ssize_t b = 0; b < raw_row && r * raw_row + PREFETCH + b < left; b += 64)
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
static void decode_tile(int type, const uint8_t *raw, Py_ssize_t raw_row, Py_ssize_t rows, Py_ssize_t k,
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

/* Whether a product's operands have a shape the kernels take: codes of `bits`
 * (4, or 8 for 5-, 6- and 8-bit codes one per byte) in groups of `group` (32;
 * or 16 for 8-bit codes), or a block form (k whole blocks, a row's decoded
 * codes within DECODED_BYTES). */
static int shape_ok(int bits, Py_ssize_t group, int half, Py_ssize_t k, int biased) {
    int db;
    Py_ssize_t dg, values, block_bytes;
    if (block_form(bits, &db, &dg, &values, &block_bytes))
        return k >= values && k % values == 0 && (db == 4 ? k / 2 : k) <= DECODED_BYTES && k / dg <= TILE_GROUPS;
    return (bits == 4 || bits == 8) && (group == GROUP || (bits == 8 && group == 16)) && k >= GROUP &&
           k % GROUP == 0 && !((half || !biased) && k / group > TILE_GROUPS);
}

/* The shape checks shared by gemv and dequantize (shape_ok), scales and
 * biases float32 or, with half, float16; a block form's scales and biases
 * are in its blocks (any buffers passed are not read). */
static int check_codes(int bits, Py_ssize_t group, int half, Py_ssize_t n, Py_ssize_t k, Py_buffer *codes,
                       Py_buffer *scales, Py_buffer *biases) {
    if (n < 1 || !shape_ok(bits, group, half, k, biases->obj != NULL)) {
        PyErr_Format(PyExc_ValueError, "bad shape, bits or group: bits=%d group=%zd n=%zd k=%zd", bits, group, n, k);
        return 0;
    }
    int db;
    Py_ssize_t dg, values, block_bytes;
    if (block_form(bits, &db, &dg, &values, &block_bytes)) return check(codes, n * (k / values) * block_bytes, "blocks");
    Py_ssize_t size = half ? 2 : 4, groups = k / group;
    return check(codes, n * (bits == 4 ? k / 2 : k), "codes") && check(scales, n * groups * size, "scales") &&
           optional_check(biases, n * groups * size, "biases");
}

/* Rows per tile: float16 scales and biases are widened for a tile of rows at a
 * time (one contiguous span each, vectorized), not row by row. */
static Py_ssize_t tile_rows(Py_ssize_t groups) {
    Py_ssize_t t = TILE_GROUPS / groups;
    return t < 1 ? 1 : t > TILE_ROWS ? TILE_ROWS : t;
}

/* The float32 scales and biases of rows [r0, r1) into *s and *b: pointers into
 * the arrays, or, with half, into wide after widening them from float16;
 * without biases (NULL), factor * each scale, made in wide. wide holds
 * 2 * TILE_GROUPS floats, and (r1 - r0) * groups <= TILE_GROUPS. */
static void tile_scales(const void *scales, const void *biases, float factor, int half, Py_ssize_t r0, Py_ssize_t r1,
                        Py_ssize_t groups, float *wide, const float **s, const float **b) {
    Py_ssize_t count = (r1 - r0) * groups;
    if (half) {
        halves((const uint16_t *)scales + r0 * groups, wide, count);
        *s = wide;
    } else {
        *s = (const float *)scales + r0 * groups;
    }
    if (!biases) {
        float *made = wide + TILE_GROUPS;
        for (Py_ssize_t i = 0; i < count; i++) made[i] = factor * (*s)[i];
        *b = made;
    } else if (half) {
        halves((const uint16_t *)biases + r0 * groups, wide + TILE_GROUPS, count);
        *b = wide + TILE_GROUPS;
    } else {
        *b = (const float *)biases + r0 * groups;
    }
}

/* One row of codes to float32: scale * code + bias. */
static void dequant_row(int bits, const uint8_t *cr, const float *s, const float *bi, float *yr, Py_ssize_t k,
                        Py_ssize_t group) {
#ifdef HAVE_X86
    if (use_avx2) {
        dequant_row_avx2(bits, cr, s, bi, yr, k, group);
        return;
    }
#endif
    for (Py_ssize_t g = 0; g < k / group; g++) {
        const float sc = s[g], b = bi[g];
        float *yg = yr + g * group;
        if (bits == 4) {
            const uint8_t *cg = cr + g * (GROUP / 2);
            for (int j = 0; j < GROUP / 2; j++) {
                yg[j] = sc * (float)(cg[j] & 15) + b;
                yg[j + GROUP / 2] = sc * (float)(cg[j] >> 4) + b;
            }
        } else {
            const uint8_t *cg = cr + g * group;
            for (Py_ssize_t j = 0; j < group; j++) yg[j] = sc * (float)cg[j] + b;
        }
    }
}

/* Quantized activations (Q8_FLAG in gemv's bits), in their own file. */
#include "_q8.c"

/* y [m, n] = x [m, k] @ W.T for an affine W (codes, scales and biases as gemv
 * below takes them; or bits a block form, c its blocks), rows of W across the
 * OpenMP threads; called without the GIL. With Q8_FLAG in bits, from
 * Q8_MIN_ROWS rows on, x is quantized (q8_run). Returns -1 when out of memory. */
static int gemv_run(int bits, const float *x, const uint8_t *c, const void *scales, const void *biases, float factor,
                    int half, float *y, Py_ssize_t m, Py_ssize_t k, Py_ssize_t n, Py_ssize_t group) {
    if (bits & Q8_FLAG) {
        bits &= ~Q8_FLAG;
        if (m >= Q8_MIN_ROWS) return q8_run(bits, x, c, scales, biases, factor, half, y, m, k, n, group);
    }
    const int type = bits - FORM_BLOCKS;
    Py_ssize_t values = 1, block_bytes = 0;
    const int blocks = block_form(bits, &bits, &group, &values, &block_bytes);
    Py_ssize_t row_bytes = bits == 4 ? k / 2 : k, groups = k / group, raw_row = blocks ? k / values * block_bytes : row_bytes;
    float *xs = malloc((size_t)(m * groups) * sizeof(float));
    if (!xs) return -1;
    group_sums(x, xs, m, k, group);
    row_fn fn = bits == 4 ? row4_portable : row8_portable;
    int wide_rows = 0; /* with one activation row: weight rows per step (AVX-512) */
#ifdef HAVE_X86
    if (use_avx2) fn = bits == 4 ? row4_avx2 : row8_avx2;
    if (use_avx512) {
        fn = bits == 4 ? row4_avx512 : row8_avx512;
        if (m == 1) wide_rows = bits == 4 && row_bytes <= WIDE_ROW_BYTES ? WROWS : 1;
    }
#endif
    Py_ssize_t tile = tile_rows(groups);
    if (blocks && tile * row_bytes > DECODED_BYTES) tile = DECODED_BYTES / row_bytes; /* >= 1: shape_ok */
    Py_ssize_t tiles = (n + tile - 1) / tile;
#ifdef HAVE_X86
    /* Decoding: the blocks decoded in registers, a weight row against each row of x in turn. */
    if (blocks && m <= DIRECT_ROWS && ((use_avx512 && direct_512(type)) || (use_avx2 && direct_avx2(type)))) {
        const int wide = use_avx512 && direct_512(type);
        #pragma omp parallel for schedule(static)
        for (Py_ssize_t t = 0; t < tiles; t++) {
            Py_ssize_t r0 = t * tile, r1 = r0 + tile < n ? r0 + tile : n;
            if (wide)
                blocks_rows_512(type, c, raw_row, r0, r1, n * raw_row, x, xs, y, m, k, n, groups);
            else
                blocks_rows_avx2(type, c, raw_row, r0, r1, n * raw_row, x, xs, y, m, k, n, groups);
        }
        free(xs);
        return 0;
    }
#endif
    for (Py_ssize_t i0 = 0; i0 < m; i0 += MAX_ROWS) {
        Py_ssize_t rows = m - i0 < MAX_ROWS ? m - i0 : MAX_ROWS;
        #pragma omp parallel for schedule(static)
        for (Py_ssize_t t = 0; t < tiles; t++) {
            Py_ssize_t r0 = t * tile, r1 = r0 + tile < n ? r0 + tile : n;
            float wide[2 * TILE_GROUPS];
            uint8_t decoded[DECODED_BYTES];
            const float *s, *bi;
            const uint8_t *ct; /* the tile's codes, row_bytes a row */
            Py_ssize_t left;   /* code bytes from the tile's start to W's end, to prefetch in; 0: none */
            if (blocks) {
                decode_tile(type, c + r0 * raw_row, raw_row, r1 - r0, k, (n - r0) * raw_row, decoded, wide,
                            wide + TILE_GROUPS);
                s = wide, bi = wide + TILE_GROUPS, ct = decoded, left = 0;
            } else {
                tile_scales(scales, biases, factor, half, r0, r1, groups, wide, &s, &bi);
                ct = c + r0 * row_bytes, left = (n - r0) * row_bytes;
            }
#ifdef HAVE_X86
            if (wide_rows) {
                tile_512(bits, group, (int)wide_rows, ct, s, bi, x, xs, y + r0, r1 - r0, k, left);
                continue;
            }
#endif
            for (Py_ssize_t r = r0; r < r1; r++) {
                /* The hardware prefetchers stop at 4 KiB pages: ask for the codes PREFETCH bytes ahead. */
                const char *ahead = (const char *)(ct + (r - r0) * row_bytes) + PREFETCH;
                for (Py_ssize_t b = 0; b < row_bytes && (r - r0) * row_bytes + PREFETCH + b < left; b += 64)
                    __builtin_prefetch(ahead + b, 0, PREFETCH_LOCALITY);
                fn(ct + (r - r0) * row_bytes, s + (r - r0) * groups, bi + (r - r0) * groups, x + i0 * k,
                   xs + i0 * groups, y + i0 * n + r, rows, k, n, group);
            }
        }
    }
    free(xs);
    return 0;
}

/* Rows [r0, r1) of W (any form gemv takes) as float32 into y (k a row):
 * scale * code + bias, the values of AffineTensor.dequantize (and of ggml's
 * dequantization, but for the sign of Q6_K's zeros: -32 * s + 32 * s is +0). */
static void dequant_rows(int bits, const uint8_t *c, const void *scales, const void *biases, float factor, int half,
                         Py_ssize_t r0, Py_ssize_t r1, Py_ssize_t k, Py_ssize_t group, float *y) {
    const int type = bits - FORM_BLOCKS;
    Py_ssize_t values = 1, block_bytes = 0;
    const int blocks = block_form(bits, &bits, &group, &values, &block_bytes);
    Py_ssize_t row_bytes = bits == 4 ? k / 2 : k, groups = k / group, raw_row = k / values * block_bytes;
    Py_ssize_t tile = tile_rows(groups);
    if (blocks && tile * row_bytes > DECODED_BYTES) tile = DECODED_BYTES / row_bytes;
    for (Py_ssize_t t0 = r0; t0 < r1; t0 += tile) {
        Py_ssize_t t1 = t0 + tile < r1 ? t0 + tile : r1;
        float wide[2 * TILE_GROUPS];
        uint8_t decoded[DECODED_BYTES];
        const float *st, *bt;
        const uint8_t *ct;
        if (blocks) {
            decode_tile(type, c + t0 * raw_row, raw_row, t1 - t0, k, 0, decoded, wide, wide + TILE_GROUPS);
            st = wide, bt = wide + TILE_GROUPS, ct = decoded;
        } else {
            tile_scales(scales, biases, factor, half, t0, t1, groups, wide, &st, &bt);
            ct = c + t0 * row_bytes;
        }
        for (Py_ssize_t r = t0; r < t1; r++)
            dequant_row(bits, ct + (r - t0) * row_bytes, st + (r - t0) * groups, bt + (r - t0) * groups,
                        y + (r - r0) * k, k, group);
    }
}

/* gemv(bits, x, codes, scales, biases, out, m, k, n[, group, half, factor]) -> None
 * x float32 [m, k]; codes uint8 [n, k/2] (4 bits) or [n, k] (8 bits);
 * scales, biases [n, k/group], float32 (or float16 with half true), biases
 * None for factor * scales; out float32 [m, n], written. group: 32 (default),
 * or 16 for 8-bit codes. */
static PyObject *gemv(PyObject *self, PyObject *args) {
    int bits, half = 0, failed;
    Py_buffer x, codes, scales, biases = {0}, out;
    PyObject *bobj;
    Py_ssize_t m, k, n, group = GROUP;
    float factor = 0.0f;
    if (!PyArg_ParseTuple(args, "iy*y*y*Ow*nnn|npf", &bits, &x, &codes, &scales, &bobj, &out, &m, &k, &n, &group,
                          &half, &factor))
        return NULL;
    PyObject *result = NULL;
    if (!optional_buffer(bobj, &biases, PyBUF_SIMPLE)) goto done;
    if (m < 1) {
        PyErr_Format(PyExc_ValueError, "bad shape: m=%zd", m);
        goto done;
    }
    if (!check_codes(bits & ~Q8_FLAG, group, half, n, k, &codes, &scales, &biases) || !check(&x, m * k * 4, "x") ||
        !check(&out, m * n * 4, "out"))
        goto done;
    Py_BEGIN_ALLOW_THREADS
    failed = gemv_run(bits, (const float *)x.buf, (const uint8_t *)codes.buf, scales.buf, biases.buf, factor, half,
                      (float *)out.buf, m, k, n, group);
    Py_END_ALLOW_THREADS
    if (failed) {
        PyErr_NoMemory();
        goto done;
    }
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&x);
    PyBuffer_Release(&codes);
    PyBuffer_Release(&scales);
    release_optional(&biases);
    PyBuffer_Release(&out);
    return result;
}

/* y [m, n] = x [m, k] @ w [n, k].T in float32, rows of w across the OpenMP threads. */
static void gemvf_run(const float *xin, const float *wt, float *y, Py_ssize_t m, Py_ssize_t k, Py_ssize_t n) {
    void (*fn)(const float *, const float *, float *, Py_ssize_t, Py_ssize_t, Py_ssize_t) = rowf_portable;
#ifdef HAVE_X86
    if (use_avx2) fn = rowf_avx2;
#endif
    for (Py_ssize_t i0 = 0; i0 < m; i0 += MAX_ROWS) {
        Py_ssize_t rows = m - i0 < MAX_ROWS ? m - i0 : MAX_ROWS;
        #pragma omp parallel for schedule(static)
        for (Py_ssize_t r = 0; r < n; r++) fn(wt + r * k, xin + i0 * k, y + i0 * n + r, rows, k, n);
    }
}

/* gemv_f32(x, w, out, m, k, n) -> None: out [m, n] = x [m, k] @ w [n, k].T in
 * float32, for the few-row products of decoding, with the same threads as
 * gemv (mixing two thread pools, BLAS's and OpenMP's, on few cores makes each
 * wait for the other's spinning workers). */
static PyObject *gemv_f32(PyObject *self, PyObject *args) {
    Py_buffer x, w, out;
    Py_ssize_t m, k, n;
    if (!PyArg_ParseTuple(args, "y*y*w*nnn", &x, &w, &out, &m, &k, &n)) return NULL;
    PyObject *result = NULL;
    if (m < 1 || k < 1 || n < 1) {
        PyErr_Format(PyExc_ValueError, "bad shape: m=%zd k=%zd n=%zd", m, k, n);
        goto done;
    }
    if (!check(&x, m * k * 4, "x") || !check(&w, n * k * 4, "w") || !check(&out, m * n * 4, "out")) goto done;
    Py_BEGIN_ALLOW_THREADS
    gemvf_run((const float *)x.buf, (const float *)w.buf, (float *)out.buf, m, k, n);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&x);
    PyBuffer_Release(&w);
    PyBuffer_Release(&out);
    return result;
}

/* dequantize(bits, codes, scales, biases, out, n, k[, parallel, group, half, factor]) -> None (biases as gemv's):
 * out float32 [n, k] = scale * code + bias, the same float32 values as
 * AffineTensor.dequantize. parallel=0 keeps it on the calling thread: before a
 * BLAS call, OpenMP workers would compete with BLAS's spinning ones. */
static PyObject *dequantize(PyObject *self, PyObject *args) {
    int bits, parallel = 1, half = 0;
    Py_buffer codes, scales, biases = {0}, out;
    PyObject *bobj;
    Py_ssize_t n, k, group = GROUP;
    float factor = 0.0f;
    if (!PyArg_ParseTuple(args, "iy*y*Ow*nn|pnpf", &bits, &codes, &scales, &bobj, &out, &n, &k, &parallel, &group,
                          &half, &factor))
        return NULL;
    PyObject *result = NULL;
    if (!optional_buffer(bobj, &biases, PyBUF_SIMPLE)) goto done;
    if (!check_codes(bits, group, half, n, k, &codes, &scales, &biases) || !check(&out, n * k * 4, "out")) goto done;
    Py_BEGIN_ALLOW_THREADS
    /* Spans of rows across the threads: a tile's scales are widened (or its blocks decoded) once. */
    const Py_ssize_t span = 32;
    #pragma omp parallel for schedule(static) if (parallel)
    for (Py_ssize_t r0 = 0; r0 < n; r0 += span)
        dequant_rows(bits, (const uint8_t *)codes.buf, scales.buf, biases.buf, factor, half, r0,
                     r0 + span < n ? r0 + span : n, k, group, (float *)out.buf + r0 * k);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&codes);
    PyBuffer_Release(&scales);
    release_optional(&biases);
    PyBuffer_Release(&out);
    return result;
}

static PyObject *simd(PyObject *self, PyObject *noargs) {
    return PyUnicode_FromString(use_avx512 ? "avx512" : use_avx2 ? "avx2+fma" : "portable");
}

static int max_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

static PyObject *threads(PyObject *self, PyObject *noargs) {
    return PyLong_FromLong(max_threads());
}

/* set_threads(n) -> None: the threads the next products may use (OpenMP's
 * omp_set_num_threads; nothing without OpenMP). */
static PyObject *set_threads(PyObject *self, PyObject *arg) {
    long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (n < 1) {
        PyErr_Format(PyExc_ValueError, "threads must be at least 1, got %ld", n);
        return NULL;
    }
#ifdef _OPENMP
    omp_set_num_threads((int)n);
#endif
    Py_RETURN_NONE;
}

/* -- per-row elementwise ops of a decoder layer -------------------------------
 *
 * One pass each over rows of float32, single-threaded (they are small). They
 * follow the numpy backend's float32 formulas step by step (built with
 * -ffp-contract=off, so no multiply-add is fused): rope is bit-identical to
 * numpy's; rms_norm differs only in the order of its sum of squares, and
 * layer_norm in the order of its two sums. */

/* sum a[c] * b[c] in eight running sums (one fixed order, vectorizable). */
static inline __attribute__((always_inline)) float dot_f32(const float *a, const float *b, Py_ssize_t n) {
    float acc[8] = {0};
    Py_ssize_t c = 0;
    for (; c + 8 <= n; c += 8)
        for (int j = 0; j < 8; j++) acc[j] += a[c + j] * b[c + j];
    float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; c < n; c++) s += a[c] * b[c];
    return s;
}

static void rms_row(const float *x, const float *w, float *y, Py_ssize_t n, float eps) {
    Py_ssize_t c;
    float scale = 1.0f / sqrtf(dot_f32(x, x, n) / (float)n + eps);
    if (w)
        for (c = 0; c < n; c++) y[c] = (x[c] * scale) * w[c];
    else
        for (c = 0; c < n; c++) y[c] = x[c] * scale;
}

/* out = rms_norm(x) row by row (w: the weight, or NULL); with res (and h):
 * h = x + res first, and out = rms_norm(h). */
static void rms_rows(const float *xi, const float *wt, float *yo, Py_ssize_t rows, Py_ssize_t n, float eps,
                     const float *res, float *h) {
    for (Py_ssize_t r = 0; r < rows; r++) {
        const float *row = xi + r * n;
        if (res) {
            const float *rr = res + r * n;
            float *hr = h + r * n;
            for (Py_ssize_t c = 0; c < n; c++) hr[c] = row[c] + rr[c];
            row = hr;
        }
        rms_row(row, wt, yo + r * n, n, eps);
    }
}

/* rms_norm(x, weight or None, out, rows, n, eps[, residual, h]) -> None. With
 * residual and h: h = x + residual first (written), and out = rms_norm(h). */
static PyObject *rms_norm(PyObject *self, PyObject *args) {
    Py_buffer x, out, w = {0}, res = {0}, h = {0};
    PyObject *wobj, *robj = Py_None, *hobj = Py_None;
    Py_ssize_t rows, n;
    float eps;
    if (!PyArg_ParseTuple(args, "y*Ow*nnf|OO", &x, &wobj, &out, &rows, &n, &eps, &robj, &hobj)) return NULL;
    PyObject *result = NULL;
    if (!optional_buffer(wobj, &w, PyBUF_SIMPLE) || !optional_buffer(robj, &res, PyBUF_SIMPLE) ||
        !optional_buffer(robj == Py_None ? Py_None : hobj, &h, PyBUF_WRITABLE))
        goto done;
    if (rows < 1 || n < 1 || !check(&x, rows * n * 4, "x") || !check(&out, rows * n * 4, "out") ||
        !optional_check(&w, n * 4, "weight") ||
        (res.obj && (!check(&res, rows * n * 4, "residual") || !check(&h, rows * n * 4, "h"))))
        goto done;
    Py_BEGIN_ALLOW_THREADS
    rms_rows((const float *)x.buf, (const float *)w.buf, (float *)out.buf, rows, n, eps, (const float *)res.buf,
             (float *)h.buf);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&x);
    PyBuffer_Release(&out);
    release_optional(&w);
    release_optional(&res);
    release_optional(&h);
    return result;
}

/* LayerNorm row by row: mean and variance in float32 (sums in dot_f32's
 * order), then (x - mean) / sqrt(variance + eps), times w and plus b where
 * given (NULL: none), as the numpy backend's formula does it. */
static void layer_rows(const float *xi, const float *w, const float *b, float *yo, Py_ssize_t rows, Py_ssize_t n,
                       float eps) {
    for (Py_ssize_t r = 0; r < rows; r++) {
        const float *x = xi + r * n;
        float *y = yo + r * n, acc[8] = {0};
        Py_ssize_t c = 0;
        for (; c + 8 <= n; c += 8)
            for (int j = 0; j < 8; j++) acc[j] += x[c + j];
        float sum = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
        for (; c < n; c++) sum += x[c];
        float mu = sum / (float)n;
        for (c = 0; c < n; c++) y[c] = x[c] - mu;
        float den = sqrtf(dot_f32(y, y, n) / (float)n + eps);
        for (c = 0; c < n; c++) {
            float v = y[c] / den;
            if (w) v = v * w[c];
            if (b) v = v + b[c];
            y[c] = v;
        }
    }
}

/* layer_norm(x, weight or None, bias or None, out, rows, n, eps) -> None; out
 * must not be x. */
static PyObject *layer_norm(PyObject *self, PyObject *args) {
    Py_buffer x, out, w = {0}, b = {0};
    PyObject *wobj, *bobj;
    Py_ssize_t rows, n;
    float eps;
    if (!PyArg_ParseTuple(args, "y*OOw*nnf", &x, &wobj, &bobj, &out, &rows, &n, &eps)) return NULL;
    PyObject *result = NULL;
    if (!optional_buffer(wobj, &w, PyBUF_SIMPLE) || !optional_buffer(bobj, &b, PyBUF_SIMPLE)) goto done;
    if (rows < 1 || n < 1 || !check(&x, rows * n * 4, "x") || !check(&out, rows * n * 4, "out") ||
        !optional_check(&w, n * 4, "weight") || !optional_check(&b, n * 4, "bias"))
        goto done;
    if (x.buf == out.buf) {
        PyErr_SetString(PyExc_ValueError, "layer_norm: out must not be x");
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    layer_rows((const float *)x.buf, (const float *)w.buf, (const float *)b.buf, (float *)out.buf, rows, n, eps);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&x);
    PyBuffer_Release(&out);
    release_optional(&w);
    release_optional(&b);
    return result;
}

static void rope_rows(const float *xi, const float *c, const float *s, float *o, Py_ssize_t t, Py_ssize_t heads,
                      Py_ssize_t d, Py_ssize_t half) {
    for (Py_ssize_t i = 0; i < t; i++)
        for (Py_ssize_t hh = 0; hh < heads; hh++) {
            const float *a = xi + (i * heads + hh) * d, *ci = c + i * half, *si = s + i * half;
            float *y = o + (i * heads + hh) * d;
            for (Py_ssize_t j = 0; j < half; j++) {
                float lo = a[j], hi = a[half + j];
                y[j] = lo * ci[j] - hi * si[j];
                y[half + j] = lo * si[j] + hi * ci[j];
            }
            for (Py_ssize_t j = 2 * half; j < d; j++) y[j] = a[j];
        }
}

/* rope(x, cos, sin, out, tokens, heads, d, half) -> None: the rotate-half form on
 * the first 2*half features of each head (x [tokens, heads, d], cos and sin
 * [tokens, half]); features past 2*half are copied. */
static PyObject *rope(PyObject *self, PyObject *args) {
    Py_buffer x, cs, sn, out;
    Py_ssize_t t, heads, d, half;
    if (!PyArg_ParseTuple(args, "y*y*y*w*nnnn", &x, &cs, &sn, &out, &t, &heads, &d, &half)) return NULL;
    PyObject *result = NULL;
    if (t < 1 || heads < 1 || half < 0 || 2 * half > d) {
        PyErr_Format(PyExc_ValueError, "bad shape: tokens=%zd heads=%zd d=%zd half=%zd", t, heads, d, half);
        goto done;
    }
    if (!check(&x, t * heads * d * 4, "x") || !check(&out, t * heads * d * 4, "out") ||
        !check(&cs, t * half * 4, "cos") || !check(&sn, t * half * 4, "sin"))
        goto done;
    Py_BEGIN_ALLOW_THREADS
    rope_rows((const float *)x.buf, (const float *)cs.buf, (const float *)sn.buf, (float *)out.buf, t, heads, d, half);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&x);
    PyBuffer_Release(&cs);
    PyBuffer_Release(&sn);
    PyBuffer_Release(&out);
    return result;
}

/* One query row and head of attention (see attention below). Compiled twice, for
 * the portable and the AVX2 path: the same operations in the same order (no
 * contraction into multiply-adds), so both give the same bits, only wider. */
/* Eight floats as one value: GCC and clang compile it to one AVX register, or two
 * SSE ones, with the same per-lane arithmetic. */
typedef float v8f __attribute__((vector_size(32)));
/* The same, at any float's alignment: loads and stores through it keep the
 * accumulators in registers (a memcpy of their array made GCC keep it on the stack). */
typedef float v8f_u __attribute__((vector_size(32), aligned(4), may_alias));
#ifndef KV_AHEAD
#define KV_AHEAD 16 /* keys ahead whose rows are asked for */
#endif

/* Keys and values stored as IEEE float16 (a pool of kv_dtype="float16") are read
 * as the float32 values they hold: the conversion is exact, so attention over a
 * float16 pool gives the bits of the same pool widened to float32 first. The
 * AVX2 path converts eight at a time with F16C (kv8_f16c); the portable one
 * through the compiler's _Float16 conversion (GCC >= 12, clang), else
 * half_to_float. */
#ifdef __FLT16_MAX__
typedef _Float16 v8h_u __attribute__((vector_size(16), aligned(2), may_alias));
#endif

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi" /* kv8 is always inlined: no call passes a v8f */
#endif
#ifdef HAVE_X86
/* The AVX2 path's loads: F16C's vcvtph2ps on eight halves at once. (GCC 12
 * expands __builtin_convertvector on _Float16 vectors one lane at a time, which
 * made a float16 pool 4x slower to attend over than a float32 one.) Written as
 * asm because kv8 is shared by every path: an intrinsic would need its caller
 * compiled for F16C, and only the AVX2 instance (half == 2) keeps this branch. */
typedef long long v2di_u __attribute__((vector_size(16), aligned(1), may_alias));
static inline __attribute__((always_inline)) v8f kv8_f16c(const uint16_t *p) {
    v8f r;
    __asm__("vcvtph2ps %1, %0" : "=x"(r) : "m"(*(const v2di_u *)p));
    return r;
}
#endif

/* Eight stored values from element i of p: float32 (half 0), float16 (half 1:
 * the portable conversion; 2: F16C, only inside AVX2 functions). */
static inline __attribute__((always_inline)) v8f kv8(const void *p, Py_ssize_t i, int half) {
    if (!half) return *(const v8f_u *)((const float *)p + i);
#ifdef HAVE_X86
    if (half == 2) return kv8_f16c((const uint16_t *)p + i);
#endif
#ifdef __FLT16_MAX__
    return __builtin_convertvector(*(const v8h_u *)((const uint16_t *)p + i), v8f);
#else
    v8f r;
    for (int l = 0; l < 8; l++) r[l] = half_to_float(((const uint16_t *)p)[i + l]);
    return r;
#endif
}

static inline __attribute__((always_inline)) float kv1(const void *p, Py_ssize_t i, int half) {
    return half ? half_to_float(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* dot_f32 of q against the stored row at element i of K (its lanes, their
 * order, its final sum), whatever the row's storage. */
static inline __attribute__((always_inline)) float dot_kv(const float *q, const void *K, Py_ssize_t i, Py_ssize_t n,
                                                          int half) {
    v8f acc = {0};
    Py_ssize_t c = 0;
    for (; c + 8 <= n; c += 8) acc += *(const v8f_u *)(q + c) * kv8(K, i + c, half);
    float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; c < n; c++) s += q[c] * kv1(K, i + c, half);
    return s;
}

/* dot_kv of one row against four (at elements i0..i3 of K), the four
 * interleaved: four dependency chains instead of one, the same bits. */
static inline __attribute__((always_inline)) void dot4_kv(const float *q, const void *K, Py_ssize_t i0, Py_ssize_t i1,
                                                          Py_ssize_t i2, Py_ssize_t i3, Py_ssize_t n, int half,
                                                          float *out) {
    v8f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    Py_ssize_t c = 0;
    for (; c + 8 <= n; c += 8) {
        const v8f x = *(const v8f_u *)(q + c);
        a0 += x * kv8(K, i0 + c, half);
        a1 += x * kv8(K, i1 + c, half);
        a2 += x * kv8(K, i2 + c, half);
        a3 += x * kv8(K, i3 + c, half);
    }
    const v8f *acc[4] = {&a0, &a1, &a2, &a3};
    const Py_ssize_t at[4] = {i0, i1, i2, i3};
    for (int r = 0; r < 4; r++) {
        const v8f v = *acc[r];
        float t = ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
        for (Py_ssize_t d = c; d < n; d++) t += q[d] * kv1(K, at[r] + d, half);
        out[r] = t;
    }
}

typedef int32_t v8i __attribute__((vector_size(32)));

/* exp of eight x <= 0 (scores less their row's maximum), within 2 ulp of expf:
 * x = n ln2 + r with |r| <= ln2 / 2, exp(r) by Cephes' degree-7 polynomial, 2^n
 * put in the exponent's bits. Plain vector arithmetic (no multiply-adds: the
 * file is built with -ffp-contract=off), so every path, and the one-lane tail
 * (exp1_below), gives the same bits. Below -87 (exp < 1.7e-38, where 2^n would
 * leave the normal floats) the result is 0: such a probability is lost beside
 * the maximum's 1 in any float32 sum. NaN stays NaN. */
static inline __attribute__((always_inline)) v8f exp8_below(v8f x) {
    const v8i keep = ~(v8i)(x < -87.0f); /* -1 in the lanes kept (NaN included) */
    const v8f xc = (v8f)(((v8i)x & keep) | ((v8i)((v8f){0} - 87.0f) & ~keep));
    const v8f f = xc * 1.44269504088896341f + 0.5f;
    v8i n = __builtin_convertvector(f, v8i); /* toward zero, then down: floor(f) */
    n += (v8i)(__builtin_convertvector(n, v8f) > f);
    const v8f nf = __builtin_convertvector(n, v8f);
    v8f r = xc - nf * 0.693359375f;
    r = r - nf * -2.12194440e-4f;
    v8f p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const v8f y = (p * (r * r) + r) + 1.0f;
    const v8f scaled = y * (v8f)((n + 127) << 23);
    return (v8f)((v8i)scaled & keep);
}

static inline __attribute__((always_inline)) float exp1_below(float x) { return exp8_below((v8f){0} + x)[0]; }

struct attend_args {
    const float *Q;
    const void *K, *V; /* float32, or IEEE float16 where half */
    float *O;
    const Py_ssize_t *rows; /* pool row of each key position; NULL: position j is row j */
    Py_ssize_t tq, tk, hq, hkv, dk, dv, window;
    float scale, softcap;
    int causal, half;
    const float *sinks; /* [hq]: one more logit per head in each softmax, with no value; NULL: none */
};

#define ROW(a, j) ((a)->rows ? (a)->rows[j] : (j))

static inline __attribute__((always_inline)) void attend(const struct attend_args *a, Py_ssize_t task,
                                                         float *scores, int half) {
    Py_ssize_t i = task / a->hq, h = task % a->hq;
    Py_ssize_t pos = a->tk - a->tq + i, lo = 0, hi = a->tk; /* visible keys: [lo, hi) */
    if (a->causal) hi = pos + 1 < a->tk ? pos + 1 : a->tk;
    if (a->window > 0 && pos - a->window + 1 > lo) lo = pos - a->window + 1;
    if (a->window > 0 && !a->causal && pos + a->window < hi) hi = pos + a->window;
    const Py_ssize_t dk = a->dk, dv = a->dv, hkv = a->hkv, size = half ? 2 : 4;
    const float *qh = a->Q + (i * a->hq + h) * dk;
    Py_ssize_t kvh = h / (a->hq / hkv);
    float *o = a->O + (i * a->hq + h) * dv;
    const char *K = a->K, *V = a->V;
#define KEY(j) ((ROW(a, j) * hkv + kvh) * dk) /* element index of key j's row */
#define VALUE(j) ((ROW(a, j) * hkv + kvh) * dv)
    for (Py_ssize_t c = 0; c < dv; c++) o[c] = 0.0f;
    if (hi <= lo) return; /* nothing visible: numpy gives NaN rows; never the case in decoding */
    float top = -INFINITY;
    Py_ssize_t j = lo;
    for (; j + 4 <= hi; j += 4) {
        float d4[4];
        if (j + KV_AHEAD + 4 <= hi) /* rows hkv * dk apart: the hardware prefetchers stop at each page */
            for (int r = 0; r < 4; r++) {
                const char *row = K + KEY(j + KV_AHEAD + r) * size;
                for (Py_ssize_t b = 0; b < dk * size; b += 64) __builtin_prefetch(row + b, 0, 3);
            }
        dot4_kv(qh, K, KEY(j), KEY(j + 1), KEY(j + 2), KEY(j + 3), dk, half, d4);
        for (int r = 0; r < 4; r++) {
            float sc = d4[r] * a->scale;
            if (a->softcap > 0.0f) sc = a->softcap * tanhf(sc / a->softcap);
            scores[j + r] = sc;
            if (sc > top) top = sc;
        }
    }
    for (; j < hi; j++) {
        float sc = dot_kv(qh, K, KEY(j), dk, half) * a->scale;
        if (a->softcap > 0.0f) sc = a->softcap * tanhf(sc / a->softcap);
        scores[j] = sc;
        if (sc > top) top = sc;
    }
    const float sink = a->sinks ? a->sinks[h] : -INFINITY;
    if (sink > top) top = sink;
    float total = a->sinks ? exp1_below(sink - top) : 0.0f;
    for (j = lo; j + 8 <= hi; j += 8) *(v8f_u *)(scores + j) = exp8_below(*(v8f_u *)(scores + j) - top);
    for (; j < hi; j++) scores[j] = exp1_below(scores[j] - top);
    for (j = lo; j < hi; j++) total += scores[j];
    for (j = lo; j < hi; j++) scores[j] /= total;
    /* o = sum_j p_j v_j, 64 columns at a time held in registers across the keys
     * (adding into o in memory made every key wait on the previous one's store);
     * each column's sum is still over j in order. */
    Py_ssize_t c0 = 0;
    for (; c0 + 64 <= dv; c0 += 64) {
        v8f acc0 = {0}, acc1 = {0}, acc2 = {0}, acc3 = {0}, acc4 = {0}, acc5 = {0}, acc6 = {0}, acc7 = {0};
        for (Py_ssize_t j = lo; j < hi; j++) {
            const Py_ssize_t vj = VALUE(j) + c0;
            if (j + KV_AHEAD < hi) {
                const char *ahead = V + (VALUE(j + KV_AHEAD) + c0) * size;
                for (int b = 0; b < 64 * size; b += 64) __builtin_prefetch(ahead + b, 0, 3);
            }
            const v8f p = (v8f){0} + scores[j];
            acc0 += p * kv8(V, vj, half), acc1 += p * kv8(V, vj + 8, half);
            acc2 += p * kv8(V, vj + 16, half), acc3 += p * kv8(V, vj + 24, half);
            acc4 += p * kv8(V, vj + 32, half), acc5 += p * kv8(V, vj + 40, half);
            acc6 += p * kv8(V, vj + 48, half), acc7 += p * kv8(V, vj + 56, half);
        }
        *(v8f_u *)(o + c0) = acc0, *(v8f_u *)(o + c0 + 8) = acc1, *(v8f_u *)(o + c0 + 16) = acc2;
        *(v8f_u *)(o + c0 + 24) = acc3, *(v8f_u *)(o + c0 + 32) = acc4, *(v8f_u *)(o + c0 + 40) = acc5;
        *(v8f_u *)(o + c0 + 48) = acc6, *(v8f_u *)(o + c0 + 56) = acc7;
    }
    for (j = lo; j < hi; j++) {
        const float p = scores[j];
        const Py_ssize_t vj = VALUE(j);
        for (Py_ssize_t c = c0; c < dv; c++) o[c] += p * kv1(V, vj + c, half);
    }
#undef KEY
#undef VALUE
}

/* Compiled per path and per storage, so that each loop knows its loads. */
static void attend_portable(const struct attend_args *a, Py_ssize_t task, float *scores) { attend(a, task, scores, 0); }
static void attend_portable_f16(const struct attend_args *a, Py_ssize_t task, float *scores) {
    attend(a, task, scores, 1);
}
#ifdef HAVE_X86
AVX2 static void attend_avx2(const struct attend_args *a, Py_ssize_t task, float *scores) { attend(a, task, scores, 0); }
AVX2 static void attend_avx2_f16(const struct attend_args *a, Py_ssize_t task, float *scores) {
    attend(a, task, scores, 2);
}
#endif

/* Every (query row, head) of a, across the OpenMP threads where parallel and
 * the work is worth it; scores holds a->tk floats per thread. */
static void attention_run(const struct attend_args *a, float *scores, int parallel) {
    void (*fn)(const struct attend_args *, Py_ssize_t, float *) = a->half ? attend_portable_f16 : attend_portable;
#ifdef HAVE_X86
    if (use_avx2) fn = a->half ? attend_avx2_f16 : attend_avx2;
#endif
    const Py_ssize_t tasks = a->tq * a->hq, tk = a->tk;
    #pragma omp parallel for schedule(static) if (parallel && tasks > 1 && tk * a->dk >= 4096)
    for (Py_ssize_t task = 0; task < tasks; task++) {
#ifdef _OPENMP
        float *mine = scores + (Py_ssize_t)omp_get_thread_num() * tk;
#else
        float *mine = scores;
#endif
        fn(a, task, mine);
    }
}

/* attention(q, k, v, out, tq, tk, hq, hkv, dk, dv, scale, causal, window, softcap[, table, block, parallel, sinks,
 *           half]) -> None
 * for the few query rows of decoding (q [tq, hq, dk], k [tk, hkv, dk], v [tk,
 * hkv, dv], out [tq, hq, dv], all float32 and contiguous): per query row and
 * head, scores over the visible keys (bottom-right aligned causal mask, and
 * the sliding window when window > 0), optional tanh soft-capping, softmax,
 * weighted sum of values. Keys outside the mask are skipped, which is what
 * their -inf scores give. The numpy path does the same with two GEMMs.
 * With a block table, keys and values are read in place from paged pools.
 * parallel=0 keeps it on the calling thread (after BLAS products, whose
 * spinning threads OpenMP's would fight for the cores). half: k and v hold
 * IEEE float16 (read exactly as the float32 values they are).
 */
static PyObject *attention(PyObject *self, PyObject *args) {
    Py_buffer q, k, v, out, table = {0}, sinks = {0};
    Py_ssize_t tq, tk, hq, hkv, dk, dv, window, block = 0;
    float scale, softcap;
    int causal, parallel = 1, half = 0;
    PyObject *tobj = Py_None, *sobj = Py_None;
    if (!PyArg_ParseTuple(args, "y*y*y*w*nnnnnnfpnf|OnpOp", &q, &k, &v, &out, &tq, &tk, &hq, &hkv, &dk, &dv, &scale,
                          &causal, &window, &softcap, &tobj, &block, &parallel, &sobj, &half))
        return NULL;
    PyObject *result = NULL;
    float *scores = NULL;
    Py_ssize_t *rows = NULL; /* pool row of each key position */
    int paged = tobj != Py_None;
    if (tq < 1 || tk < 1 || hq < 1 || hkv < 1 || hq % hkv || dk < 1 || dv < 1 || (paged && block < 1)) {
        PyErr_Format(PyExc_ValueError, "bad shape: tq=%zd tk=%zd hq=%zd hkv=%zd block=%zd", tq, tk, hq, hkv, block);
        goto done;
    }
    /* Contiguous: k [tk, hkv, dk]. Paged: k and v are pools [blocks, block, hkv, d]
     * and the int64 table maps logical block b to its physical block. */
    const Py_ssize_t size = half ? 2 : 4; /* bytes of a stored key or value */
    Py_ssize_t pool_rows = paged ? k.len / (hkv * dk * size) : tk;
    if (!optional_buffer(tobj, &table, PyBUF_SIMPLE) || !optional_buffer(sobj, &sinks, PyBUF_SIMPLE)) goto done;
    if (!check(&q, tq * hq * dk * 4, "q") || !check(&k, pool_rows * hkv * dk * size, "k") ||
        !check(&v, pool_rows * hkv * dv * size, "v") || !check(&out, tq * hq * dv * 4, "out") ||
        !optional_check(&table, ((tk + block - 1) / block) * 8, "block table") ||
        !optional_check(&sinks, hq * 4, "sinks"))
        goto done;
    scores = malloc((size_t)tk * max_threads() * sizeof(float));
    rows = malloc((size_t)tk * sizeof(Py_ssize_t));
    if (!scores || !rows) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t j = 0; j < tk; j++) {
        Py_ssize_t r = j;
        if (paged) {
            int64_t b = ((const int64_t *)table.buf)[j / block];
            r = (Py_ssize_t)b * block + j % block;
            if (b < 0 || r >= pool_rows) {
                PyErr_Format(PyExc_IndexError, "block table entry %lld is outside the pool of %zd blocks",
                             (long long)b, pool_rows / block);
                goto done;
            }
        }
        rows[j] = r;
    }
    Py_BEGIN_ALLOW_THREADS
    struct attend_args a = {(const float *)q.buf, k.buf, v.buf, (float *)out.buf, rows,
                            tq, tk, hq, hkv, dk, dv, window, scale, softcap, causal, half,
                            sinks.buf ? (const float *)sinks.buf : NULL};
    attention_run(&a, scores, parallel);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    free(scores);
    free(rows);
    release_optional(&table);
    release_optional(&sinks);
    PyBuffer_Release(&q);
    PyBuffer_Release(&k);
    PyBuffer_Release(&v);
    PyBuffer_Release(&out);
    return result;
}

#ifdef HAVE_X86
static int cpu_avx2(void) {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
static int cpu_avx512(void) {
    return cpu_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl");
}
static int cpu_vnni(void) { return cpu_avx512() && __builtin_cpu_supports("avx512vnni"); }
#endif

/* paths() -> list: the code paths this CPU can run, best last. */
static PyObject *paths(PyObject *self, PyObject *noargs) {
#ifdef HAVE_X86
    if (cpu_avx512()) return Py_BuildValue("[sss]", "portable", "avx2+fma", "avx512");
    if (cpu_avx2()) return Py_BuildValue("[ss]", "portable", "avx2+fma");
#endif
    return Py_BuildValue("[s]", "portable");
}

/* use_simd(name) -> None: "portable", "avx2+fma" or "avx512" (where the CPU has it). */
static PyObject *use_simd(PyObject *self, PyObject *arg) {
    const char *name = PyUnicode_AsUTF8(arg);
    if (!name) return NULL;
    if (strcmp(name, "portable") == 0) {
        use_avx2 = use_avx512 = use_vnni = 0;
    } else if (strcmp(name, "avx2+fma") == 0 || strcmp(name, "avx512") == 0) {
        int wide = name[3] == '5';
#ifdef HAVE_X86
        if (!(wide ? cpu_avx512() : cpu_avx2())) {
            PyErr_Format(PyExc_ValueError, "this CPU has no %s", wide ? "AVX-512 F+BW+VL" : "AVX2+FMA+F16C");
            return NULL;
        }
        use_avx2 = 1;
        use_avx512 = wide;
        use_vnni = wide && cpu_vnni();
#else
        PyErr_SetString(PyExc_ValueError, "built without the x86 paths");
        return NULL;
#endif
    } else {
        PyErr_Format(PyExc_ValueError, "unknown code path %R (portable, avx2+fma, avx512)", arg);
        return NULL;
    }
    Py_RETURN_NONE;
}

/* block_forms() -> dict: the GGML block types gemv and dequantize read as stored, and the
 * form (bits argument) that names each. */
static PyObject *block_forms(PyObject *self, PyObject *noargs) {
    return Py_BuildValue("{sisisisisisisisi}", "Q4_0", FORM_BLOCKS + GGML_Q4_0, "Q4_1", FORM_BLOCKS + GGML_Q4_1,
                         "Q5_0", FORM_BLOCKS + GGML_Q5_0, "Q5_1", FORM_BLOCKS + GGML_Q5_1, "Q8_0", FORM_BLOCKS + GGML_Q8_0,
                         "Q4_K", FORM_BLOCKS + GGML_Q4_K, "Q5_K", FORM_BLOCKS + GGML_Q5_K, "Q6_K", FORM_BLOCKS + GGML_Q6_K);
}

/* to_half(src, out, n) -> None: n float32 values of src rounded to IEEE float16
 * into out, by float_to_half: what a captured step's write into a float16 pool
 * computes (tests hold it to numpy's astype). */
static PyObject *to_half(PyObject *self, PyObject *args) {
    Py_buffer src, out;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "y*w*n", &src, &out, &n)) return NULL;
    PyObject *result = NULL;
    if (n < 0 || !check(&src, n * 4, "src") || !check(&out, n * 2, "out")) goto done;
    for (Py_ssize_t i = 0; i < n; i++) ((uint16_t *)out.buf)[i] = float_to_half(((const float *)src.buf)[i]);
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&src);
    PyBuffer_Release(&out);
    return result;
}

/* The captured decode step's program runner (run_plan), in its own file. */
#include "_plan.c"

static PyMethodDef methods[] = {
    {"use_simd", use_simd, METH_O, "Choose the code path (\"portable\", \"avx2+fma\" or \"avx512\")."},
    {"paths", paths, METH_NOARGS, "The code paths this CPU can run, best last."},
    {"block_forms", block_forms, METH_NOARGS, "GGML block types read as stored, and their forms."},
    {"gemv", gemv, METH_VARARGS, "y = x @ W.T for an affine-quantized W (see the module source)."},
    {"rms_norm", rms_norm, METH_VARARGS, "RMS norm of float32 rows (optionally after adding a residual)."},
    {"layer_norm", layer_norm, METH_VARARGS, "LayerNorm of float32 rows (optional weight and bias)."},
    {"rope", rope, METH_VARARGS, "Rotary embedding, rotate-half form, float32."},
    {"to_half", to_half, METH_VARARGS, "Float32 to IEEE float16, rounded to nearest even (as a captured write)."},
    {"attention", attention, METH_VARARGS, "Attention for a few query rows, float32."},
    {"gemv_f32", gemv_f32, METH_VARARGS, "y = x @ W.T for a float32 W with few rows of x."},
    {"dequantize", dequantize, METH_VARARGS, "W as float32 into a buffer."},
    {"run_plan", run_plan, METH_VARARGS, "Run a captured decode step's program (see _plan.c)."},
    {"opcodes", opcodes, METH_NOARGS, "The programs' opcodes by name (see _plan.c)."},
    {"simd", simd, METH_NOARGS, "The code path chosen for this CPU."},
    {"threads", threads, METH_NOARGS, "Threads a product may use (OpenMP), 1 without OpenMP."},
    {"set_threads", set_threads, METH_O, "Set the threads the next products may use (OpenMP)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_affine", NULL, -1, methods};

PyMODINIT_FUNC PyInit__affine(void) {
#ifdef HAVE_X86
    __builtin_cpu_init();
    use_avx2 = cpu_avx2();
    use_avx512 = cpu_avx512();
    use_vnni = use_avx512 && cpu_vnni();
#endif
    PyObject *mod = PyModule_Create(&module);
    if (mod && PyModule_AddIntConstant(mod, "Q8_FLAG", Q8_FLAG) < 0) Py_CLEAR(mod);
    return mod;
}
