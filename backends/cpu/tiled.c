/* Exact (float32) products of many activation rows on quantized weights: a
 * blocked GEMM that decodes each tile of W once and reuses it, from L1, for
 * every row of x (prefill, and decoding batches past the crossover).
 *
 * y [m, n] = x [m, k] @ W.T for W in any form gemv takes (affine codes, or
 * GGML blocks as stored). Rows of W go to the threads a panel of `nr` at a
 * time (32 on AVX-512, 16 on AVX2 and the portable path). A thread:
 *
 *   1. decodes its panel's rows to float32 (dequant_rows: scale * code + bias,
 *      the values AffineTensor.dequantize gives), row by row into a buffer;
 *   2. for each chunk of TILED_KC columns, transposes the chunk into the
 *      panel tile [kc][nr] (16 KiB at nr 16, 32 KiB at 32: it stays in L1);
 *   3. runs the micro-kernel over every block of `mr` rows of x against the
 *      tile: mr x nr sums held in registers (AVX-512: 12 x 32 in 24 zmm; AVX2:
 *      6 x 16 in 12 ymm), each step one (or two) vector loads of the tile, one
 *      broadcast of x per row and mr x nr / lanes fused multiply-adds.
 *
 * Against the old prefill (the weight dequantized in 2 MiB slabs on one thread,
 * then BLAS, which packs the slab again): the decoding runs on every thread
 * and the decoded panel is packed once, in the layout the micro-kernel reads.
 *
 * Sum order: y[i, r] = (((0 + x[i,0] w[r,0]) + x[i,1] w[r,1]) + ...) over the
 * columns in order, one fused multiply-add a column on AVX2 and AVX-512 (so
 * those two paths give the same bits), a product then a sum on the portable
 * path. Each output is its own chain: it depends neither on the other rows of
 * x in the call nor on the panel or chunk sizes. Against BLAS's blocked order
 * the error bound is of the same form, |y - x.w| <= k u sum_c |x_c w_c| (u =
 * 2^-24; in practice about sqrt(k) u of it: docs/performance.md, "The exact
 * prefill kernel"). */

#include "kernels.h"

/* Micro-kernel on the portable path: `rows` (up to MR) rows of x, packed
 * (column c of row i at x[c * MR + i]), against a tile of 16 weight rows
 * (tile [kc][16]); y's rows ldy apart, `valid` of the 16 columns written;
 * `first`: the chunk starts the sums (else they continue from y). */
#define PORTABLE_NR 16
#define PORTABLE_MR 4

static void micro_portable(const float *tile, Py_ssize_t kc, const float *x, float *y, Py_ssize_t ldy,
                           Py_ssize_t rows, Py_ssize_t valid, int first) {
    float acc[PORTABLE_MR][PORTABLE_NR];
    for (Py_ssize_t i = 0; i < rows; i++)
        for (Py_ssize_t r = 0; r < PORTABLE_NR; r++) acc[i][r] = first || r >= valid ? 0.0f : y[i * ldy + r];
    for (Py_ssize_t c = 0; c < kc; c++) {
        const float *w = tile + c * PORTABLE_NR;
        for (Py_ssize_t i = 0; i < rows; i++) {
            const float v = x[c * PORTABLE_MR + i];
            for (int r = 0; r < PORTABLE_NR; r++) acc[i][r] += v * w[r];
        }
    }
    for (Py_ssize_t i = 0; i < rows; i++)
        for (Py_ssize_t r = 0; r < valid; r++) y[i * ldy + r] = acc[i][r];
}

/* tile [kc][nr] = rows [nr][k] (from column c0), one value at a time. */
static void transpose_portable(const float *rows, Py_ssize_t k, Py_ssize_t c0, Py_ssize_t kc, Py_ssize_t nr,
                               float *tile) {
    for (Py_ssize_t r = 0; r < nr; r++)
        for (Py_ssize_t c = 0; c < kc; c++) tile[c * nr + r] = rows[r * k + c0 + c];
}

/* Panel width and micro-kernel rows of the path in use. */
static void tiled_shape(Py_ssize_t *nr, Py_ssize_t *mr) {
#ifdef HAVE_X86
    if (use_avx512) {
        *nr = TILED_NR_512, *mr = TILED_MR_512;
        return;
    }
    if (use_avx2) {
        *nr = TILED_NR_AVX2, *mr = TILED_MR_AVX2;
        return;
    }
#endif
    *nr = PORTABLE_NR, *mr = PORTABLE_MR;
}

/* x [m, k] packed for the micro-kernels, once a call: blocks of mr rows, each
 * column's mr values together (xp[(b * k + c) * mr + i] = x[b * mr + i, c],
 * zero past m). Reading x's rows in place, the mr rows k floats apart fall in
 * one L1 set whenever k * 4 is a multiple of 4 KiB (2,048 columns: every
 * layer's), and the broadcasts missed; packed they are one stream. */
static void pack_x(const float *x, float *xp, Py_ssize_t m, Py_ssize_t k, Py_ssize_t mr) {
    const Py_ssize_t blocks = (m + mr - 1) / mr;
    #pragma omp for schedule(static)
    for (Py_ssize_t b = 0; b < blocks; b++) {
        float *o = xp + b * k * mr;
        for (Py_ssize_t i = 0; i < mr; i++) {
            const Py_ssize_t row = b * mr + i;
            if (row < m) {
                const float *xi = x + row * k;
                for (Py_ssize_t c = 0; c < k; c++) o[c * mr + i] = xi[c];
            } else {
                for (Py_ssize_t c = 0; c < k; c++) o[c * mr + i] = 0.0f;
            }
        }
    }
}

/* One decoded panel (rows: nr rows of k floats, the ones past `valid` zero)
 * against every row of x (packed, xp): the chunks of TILED_KC columns in
 * order, each transposed into tile and run by the path's micro-kernel. y:
 * column r0 of row 0. */
static void panel_run(const float *rows, float *tile, Py_ssize_t nr, Py_ssize_t mr, Py_ssize_t valid,
                      const float *xp, float *y, Py_ssize_t m, Py_ssize_t k, Py_ssize_t n) {
    for (Py_ssize_t c0 = 0; c0 < k; c0 += TILED_KC) {
        const Py_ssize_t kc = k - c0 < TILED_KC ? k - c0 : TILED_KC;
        const int first = c0 == 0;
#ifdef HAVE_X86
        if (use_avx512) {
            transpose_avx2(rows, k, c0, kc, nr, tile);
            for (Py_ssize_t i = 0; i < m; i += mr)
                micro_512(tile, kc, xp + (i * k + c0 * mr), y + i * n, n, m - i < mr ? m - i : mr, valid, first);
            continue;
        }
        if (use_avx2) {
            transpose_avx2(rows, k, c0, kc, nr, tile);
            for (Py_ssize_t i = 0; i < m; i += mr)
                micro_avx2(tile, kc, xp + (i * k + c0 * mr), y + i * n, n, m - i < mr ? m - i : mr, valid, first);
            continue;
        }
#endif
        transpose_portable(rows, k, c0, kc, nr, tile);
        for (Py_ssize_t i = 0; i < m; i += mr)
            micro_portable(tile, kc, xp + (i * k + c0 * mr), y + i * n, n, m - i < mr ? m - i : mr, valid, first);
    }
}

/* y [m, n] = x [m, k] @ W.T, W as gemv_run takes it (bits without Q8_FLAG);
 * panels of rows across the OpenMP threads, called without the GIL. Returns
 * -1 when out of memory. */
int tiled_run(int bits, const float *x, const uint8_t *c, const void *scales, const void *biases, float factor,
              int half, float *y, Py_ssize_t m, Py_ssize_t k, Py_ssize_t n, Py_ssize_t group) {
    Py_ssize_t nr, mr;
    tiled_shape(&nr, &mr);
    const Py_ssize_t panels = (n + nr - 1) / nr;
    float *xp = alloc64((size_t)(((m + mr - 1) / mr) * mr * k) * sizeof(float));
    if (!xp) return -1;
    int failed = 0;
    #pragma omp parallel
    {
        pack_x(x, xp, m, k, mr); /* a worksharing loop: its barrier ends the packing before any panel */
        /* Each thread's decoded rows [nr][k] and tile [TILED_KC][nr], 64-byte aligned. */
        float *rows = alloc64((size_t)(nr * k + TILED_KC * nr) * sizeof(float));
        if (!rows) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(static)
        for (Py_ssize_t p = 0; p < panels; p++) {
            if (!rows) continue;
            const Py_ssize_t r0 = p * nr, valid = n - r0 < nr ? n - r0 : nr;
            dequant_rows(bits, c, scales, biases, factor, half, r0, r0 + valid, k, group, rows);
            if (valid < nr) memset(rows + valid * k, 0, (size_t)((nr - valid) * k) * sizeof(float));
            panel_run(rows, rows + nr * k, nr, mr, valid, xp, y + r0, m, k, n);
        }
        free(rows);
    }
    free(xp);
    return failed ? -1 : 0;
}
