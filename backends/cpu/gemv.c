/* Matrix-vector products on affine-quantized weights (the CPU kernels' products).
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
 * time (blocks.c).
 *
 * Also: dequantization into a caller's float32 buffer (for products with many
 * rows, where BLAS on the dequantized matrix is faster).
 *
 * The portable rows are here; the AVX2 and AVX-512 ones are in x86/. */

#include "kernels.h"

static void group_sums(const float *x, float *xs, Py_ssize_t m, Py_ssize_t k, Py_ssize_t group) {
    Py_ssize_t groups = k / group;
    for (Py_ssize_t i = 0; i < m; i++)
        for (Py_ssize_t g = 0; g < groups; g++) {
            float s = 0.0f;
            for (Py_ssize_t j = 0; j < group; j++) s += x[i * k + g * group + j];
            xs[i * groups + g] = s;
        }
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


/* n float16 values to float32 (F16C on the AVX2 path, sixteen at a time on AVX-512). */
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

/* Whether a product's operands have a shape the kernels take: codes of `bits`
 * (4, or 8 for 5-, 6- and 8-bit codes one per byte) in groups of `group` (32;
 * or 16 for 8-bit codes), or a block form (k whole blocks, a row's decoded
 * codes within DECODED_BYTES). */
int shape_ok(int bits, Py_ssize_t group, int half, Py_ssize_t k, int biased) {
    int db;
    Py_ssize_t dg, values, block_bytes;
    if (block_form(bits, &db, &dg, &values, &block_bytes))
        return k >= values && k % values == 0 && (db == 4 ? k / 2 : k) <= DECODED_BYTES && k / dg <= TILE_GROUPS;
    return (bits == 4 || bits == 8) && (group == GROUP || (bits == 8 && group == 16)) && k >= GROUP &&
           k % GROUP == 0 && !((half || !biased) && k / group > TILE_GROUPS);
}

/* Rows per tile: float16 scales and biases are widened for a tile of rows at a
 * time (one contiguous span each, vectorized), not row by row. */
Py_ssize_t tile_rows(Py_ssize_t groups) {
    Py_ssize_t t = TILE_GROUPS / groups;
    return t < 1 ? 1 : t > TILE_ROWS ? TILE_ROWS : t;
}

/* The float32 scales and biases of rows [r0, r1) into *s and *b: pointers into
 * the arrays, or, with half, into wide after widening them from float16;
 * without biases (NULL), factor * each scale, made in wide. wide holds
 * 2 * TILE_GROUPS floats, and (r1 - r0) * groups <= TILE_GROUPS. */
void tile_scales(const void *scales, const void *biases, float factor, int half, Py_ssize_t r0, Py_ssize_t r1,
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


/* y [m, n] = x [m, k] @ W.T for an affine W (codes, scales and biases as gemv
 * below takes them; or bits a block form, c its blocks), rows of W across the
 * OpenMP threads; called without the GIL. With Q8_FLAG in bits x is
 * quantized (q8_run). Returns -1 when out of memory. */
int gemv_run(int bits, const float *x, const uint8_t *c, const void *scales, const void *biases, float factor,
             int half, float *y, Py_ssize_t m, Py_ssize_t k, Py_ssize_t n, Py_ssize_t group) {
    if (bits & Q8_FLAG) {
        return q8_run(bits & ~Q8_FLAG, x, c, scales, biases, factor, half, y, m, k, n, group);
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
void dequant_rows(int bits, const uint8_t *c, const void *scales, const void *biases, float factor, int half,
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

/* y [m, n] = x [m, k] @ w [n, k].T in float32, rows of w across the OpenMP threads. */
void gemvf_run(const float *xin, const float *wt, float *y, Py_ssize_t m, Py_ssize_t k, Py_ssize_t n) {
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
