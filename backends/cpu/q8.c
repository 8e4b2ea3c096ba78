/* Quantized activations (infer.load(..., activations="q8")): gemv_run hands a
 * product whose bits carry Q8_FLAG to q8_run.
 *
 * A product y = x @ W.T with x's rows rounded to int8 and W's codes as they
 * are (the affine form of gemv.c: W[r, c] = scale[r, g] * code[r, c] +
 * bias[r, g]), multiplied in integer dot products:
 *
 *     y[i, r] = sum_g scale[r, g] * dx[i, g] * sum_{c in g} code[r, c] * q[i, c]
 *             + sum_g bias[r, g] * (dx[i, g] * sum_{c in g} q[i, c])
 *
 * Each 32 consecutive values of a row of x get one scale, dx = max|x| / 127,
 * and codes q = rint(x * 127 / max|x|) in [-127, 127] (ggml's Q8_0 rounding of
 * activations). Both terms read the rounded x, so y is W times the rounded x:
 * the bias term sums the rounded values (as ggml's Q8_1 keeps d * sum(q) for
 * its min term), not x itself. Summing x exactly there leaves the code term's
 * rounding errors weighted by codes that are all >= 0 (scale * code ranges
 * over [0, 15 scale] for Q4_1, where W is centred), which do not cancel: on
 * SmolLM2 that doubled each product's error and made KL(exact || q8) 6x
 * larger (docs/quantization.md). The integer sums are exact (a group's is
 * below 2^24, so exact as a float too), and the float arithmetic after them is
 * one fixed sequence on every path, so every path gives the same bits
 * (tests/test_activations_q8.py):
 *
 * Lanes. The groups of a row are taken sixteen at a time (a span; the last
 * padded with empty groups), group l of a span in lane l of a 16-lane
 * accumulator: per span, lane l adds (float)isum_l * (scale_l * dx_l), then
 * bias_l * xsum_l, each in one fused multiply-add (fmaf on the portable path:
 * one rounding, as the instruction; the AVX2 and AVX-512 paths have it, and two
 * fewer float operations per lane and span beside the integer work measured
 * faster, docs/performance.md "The int8 prefill kernel"); the sixteen lanes are summed at the end as lane l + lane l+8, then +4, +2,
 * +1. So that one integer dot product instruction (AVX-512 VNNI's vpdpbusd:
 * four bytes of codes times four of q into one int32 lane) sums one group in
 * each lane, both operands are stored interleaved: four bytes of each of the
 * sixteen groups, then the next four of each, ...; x once per call, each tile
 * of W's rows after decoding it.
 *
 * Paths: AVX-512 with VNNI (vpdpbusd); AVX2 (vpmaddubsw then vpmaddwd: codes
 * above 127, Q8_0's and 8-bit affine's, are taken as code - 128 with
 * vpsignb, and 128 * sum(q) added back); the portable loops (the x86 ones: x86/q8_x86.c).
 *
 * One activation row (a decode step) on block-form weights takes q8_vec instead:
 * the blocks multiplied as stored, the same lanes and bits (x86/q8row_x86.c);
 * so do a few rows (a small batch's decode step): on AVX2 two to Q8_FEW, each span decoded once for all,
 * on AVX-512 VNNI two to Q8_FEW_VNNI (Q8_FEW_VNNI_K for the K types), the one-row kernel for each in turn
 * (q8_few_rows_vnni).
 * It once stayed on the exact kernels, on the belief that decoding reads the
 * weights at the memory's speed either way; on two threads of a fast-memory
 * CPU the exact decode of a 1B model is bound by its arithmetic instead (its
 * step scaled 1.85x from one thread to two), docs/performance.md. */

#include "kernels.h"

/* Interleaving. Value p of group g lies at (g / 16) * 16 * group + (p / 4) * 64 + (g % 16) * 4 + p % 4 in the
 * interleaved order: within a span of sixteen groups the 4-byte chunks are transposed, chunk c of group l
 * going to c * 64 + l * 4. q8_interleave moves a row of k values in column order (groups of `group`, whole
 * groups) into that order, four bytes at a time; the padding of a last, partial span is zeros. It replaced a
 * byte-at-a-time loop that divided by the group size for every value: on AVX2, which has no packing kernel
 * of its own, that loop was 30% of a 1B model's q8 prefill samples (AMD EPYC, Zen 3). */
static void q8_interleave(const uint8_t *in, Py_ssize_t k, Py_ssize_t group, Py_ssize_t kp, uint8_t *out) {
    const Py_ssize_t span = group * Q8_LANES, chunks = group / 4, whole = k / span * span;
    if (kp > whole) memset(out + whole, 0, (size_t)(kp - whole));
    for (Py_ssize_t s0 = 0; s0 < k; s0 += span) {
        const Py_ssize_t groups = (k - s0) / group < Q8_LANES ? (k - s0) / group : Q8_LANES;
        for (Py_ssize_t l = 0; l < groups; l++)
            for (Py_ssize_t c = 0; c < chunks; c++) memcpy(out + s0 + c * 4 * Q8_LANES + l * 4, in + s0 + l * group + c * 4, 4);
    }
}

/* k values of x quantized in column order into q, and their groups' scales, sums and scaled sums into dx, qs
 * and xs (`lanes` of each, zeros past the row's groups): the AVX-512 or AVX2 quantizer where the path has one,
 * else the portable loop; the same float32 operations on each (max|x|, amax / 127, 127 / amax, x * id rounded
 * to nearest even, clamped), so the same codes and sums on every path. */
static void q8_quantize_natural(const float *x, Py_ssize_t k, Py_ssize_t group, Py_ssize_t lanes, int8_t *q,
                                float *dx, float *xs, int32_t *qs) {
    memset(dx, 0, (size_t)lanes * sizeof(float));
    memset(xs, 0, (size_t)lanes * sizeof(float));
    memset(qs, 0, (size_t)lanes * sizeof(int32_t));
#ifdef HAVE_X86
    if (use_avx512) {
        q8_quantize_natural_512(x, k, group, q, dx, xs, qs);
        return;
    }
    if (use_avx2) {
        q8_quantize_natural_avx2(x, k, group, q, dx, xs, qs);
        return;
    }
#endif
    for (Py_ssize_t b = 0; b < k; b += 32) {
        float amax = 0.0f;
        for (int t = 0; t < 32; t++) {
            float a = fabsf(x[b + t]);
            amax = a > amax ? a : amax;
        }
        const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
        for (int t = 0; t < 32; t++) {
            int v = (int)rintf(x[b + t] * id);
            v = v > 127 ? 127 : v < -127 ? -127 : v;
            q[b + t] = (int8_t)v;
            qs[(b + t) / group] += v;
        }
        for (Py_ssize_t g = b / group; g < (b + 32) / group; g++) dx[g] = d;
    }
    for (Py_ssize_t g = 0; g < k / group; g++) xs[g] = dx[g] * (float)qs[g]; /* the rounded group's sum */
}

/* Row i of x [.., k] quantized into X's row j in the interleaved order the tile kernels read, through
 * `natural` (k bytes in column order). */
static void q8_quantize_row(const float *x, Py_ssize_t k, struct q8x *X, Py_ssize_t j, int8_t *natural) {
    q8_quantize_natural(x, k, X->group, X->lanes, natural, X->dx + j * X->lanes, X->xs + j * X->lanes,
                        X->qs + j * X->lanes);
    q8_interleave((const uint8_t *)natural, k, X->group, X->kp, (uint8_t *)(X->q + j * X->kp));
}

/* One row of decoded codes (4 bits two a byte, GGML's order in groups of 32; or 8) into the interleaved
 * order, through `natural` (k bytes); the padding is zeros. */
static void q8_pack_row(int bits, const uint8_t *cr, Py_ssize_t k, Py_ssize_t group, Py_ssize_t kp, uint8_t *out,
                        uint8_t *natural) {
    if (bits == 4) {
        for (Py_ssize_t g = 0; g < k / 32; g++) {
            const uint8_t *b = cr + g * 16;
            uint8_t *o = natural + g * 32;
            for (int p = 0; p < 16; p++) o[p] = b[p] & 15, o[p + 16] = b[p] >> 4;
        }
        cr = natural;
    }
    q8_interleave(cr, k, group, kp, out);
}

/* The sixteen lanes summed: l + l+8, then +4, +2, +1. */
static inline float q8_fold(float *a) {
    for (int w = 8; w >= 1; w /= 2)
        for (int l = 0; l < w; l++) a[l] = a[l] + a[l + w];
    return a[0];
}

/* Portable: rows [0, R) of a tile (packed codes wq, lane scales ws and biases wb, X's lanes apart) against
 * activation rows [j0, j1) of X, into y (y[j * n + r]). */
static void q8_block_portable(const uint8_t *wq, const float *ws, const float *wb, Py_ssize_t R, const struct q8x *X,
                              Py_ssize_t j0, Py_ssize_t j1, float *y, Py_ssize_t n) {
    const Py_ssize_t chunks = X->group / 4, span = X->group * Q8_LANES;
    for (Py_ssize_t r = 0; r < R; r++)
        for (Py_ssize_t j = j0; j < j1; j++) {
            float acc[Q8_LANES] = {0};
            const uint8_t *w = wq + r * X->kp;
            const int8_t *q = X->q + j * X->kp;
            for (Py_ssize_t s = 0; s < X->spans; s++)
                for (int l = 0; l < Q8_LANES; l++) {
                    int32_t isum = 0;
                    for (Py_ssize_t c = 0; c < chunks; c++)
                        for (int b = 0; b < 4; b++) {
                            Py_ssize_t o = s * span + c * 4 * Q8_LANES + l * 4 + b;
                            isum += (int32_t)w[o] * (int32_t)q[o];
                        }
                    Py_ssize_t g = s * Q8_LANES + l;
                    float t = ws[r * X->lanes + g] * X->dx[j * X->lanes + g];
                    acc[l] = fmaf((float)isum, t, acc[l]);
                    acc[l] = fmaf(wb[r * X->lanes + g], X->xs[j * X->lanes + g], acc[l]);
                }
            y[j * n + r] = q8_fold(acc);
        }
}

/* X's shape for rows of k values in groups of `group` (whole spans of sixteen
 * groups) and room for `rows` of them; 0, or -1 when out of memory (X is then
 * still safe to free with q8x_free). */
static int q8x_alloc(struct q8x *X, Py_ssize_t group, Py_ssize_t k, Py_ssize_t rows) {
    X->group = group;
    X->groups = k / group;
    X->spans = (X->groups + Q8_LANES - 1) / Q8_LANES;
    X->lanes = X->spans * Q8_LANES;
    X->kp = X->lanes * group;
    X->q = alloc64((size_t)(rows * X->kp)); /* each row starts a line: kp is a multiple of 256, lanes of 16 */
    X->dx = alloc64((size_t)(rows * X->lanes) * sizeof(float));
    X->xs = alloc64((size_t)(rows * X->lanes) * sizeof(float));
    X->qs = alloc64((size_t)(rows * X->lanes) * sizeof(int32_t));
    return X->q && X->dx && X->xs && X->qs ? 0 : -1;
}

static void q8x_free(struct q8x *X) {
    free(X->q);
    free(X->dx);
    free(X->xs);
    free(X->qs);
}

/* One activation row (a decode step) against block-form W: x quantized once in
 * column order, each weight row's blocks multiplied as stored (x86/q8row_x86.c),
 * rows across the OpenMP threads; against an affine W (codes a nibble or a byte,
 * in groups of 32, or bytes in groups of 16) its codes read in place the same
 * way (q8_rows_affine_avx2). On AVX2 without VNNI, m rows up to Q8_FEW (a
 * small batch's decode step, a speculative verification) on block-form W too,
 * each weight row's spans decoded once for all of them (q8_few_rows_avx2): at 2
 * to 5 rows 1.0-1.5x the tiles' speed on the Zen 3, from 6 rows on Q4_K slower
 * than them (docs/performance.md, "A few rows on AVX2"). On AVX-512 VNNI, up to
 * Q8_FEW_VNNI rows (Q8_FEW_VNNI_K on the K types) the one-row kernel for each in
 * turn, each weight row read from memory once (q8_few_rows_vnni): on a Zen 4 at
 * 2 rows 0.38-0.81x the tiles' time, past 4 rows (2 for the K types) slower
 * (docs/performance.md, "A few rows on AVX-512"). The bits are q8_run's (the
 * top of this file); what it saves is q8_run's decoding, packing and
 * interleaving of every tile, which cost more than the integer products at one
 * row. Returns 1 where it has no kernel (another form, more rows, or the
 * portable path: q8_run then computes it), -1 when out of memory. */
static int q8_vec(int bits, const float *x, const uint8_t *c, const void *scales, const void *biases, float factor,
                  int half, float *y, Py_ssize_t m, Py_ssize_t k, Py_ssize_t n, Py_ssize_t group) {
#ifdef HAVE_X86
    const int type = bits - FORM_BLOCKS;
    int code_bits = bits;
    Py_ssize_t values = 1, block_bytes = 0;
    const int blocks = block_form(bits, &code_bits, &group, &values, &block_bytes);
    const int affine = !blocks && ((bits == 4 && group == 32) || (bits == 8 && (group == 32 || group == 16)));
    if (!(use_vnni || use_avx2) || !(blocks || affine)) return 1;
    const int k_type = type == GGML_Q4_K || type == GGML_Q5_K || type == GGML_Q6_K;
    if (m > 1 && (!blocks || m > (!use_vnni ? Q8_FEW : k_type ? Q8_FEW_VNNI_K : Q8_FEW_VNNI))) return 1;
    const Py_ssize_t raw_row = blocks ? k / values * block_bytes : bits == 4 ? k / 2 : k;
    struct q8x X;
    const int failed = q8x_alloc(&X, group, k, m);
    if (!failed) {
        memset(X.q, 0, (size_t)(m * X.kp)); /* the last span's padding */
        for (Py_ssize_t i = 0; i < m; i++)
            q8_quantize_natural(x + i * k, k, group, X.lanes, X.q + i * X.kp, X.dx + i * X.lanes, X.xs + i * X.lanes,
                                X.qs + i * X.lanes);
        const Py_ssize_t tile = TILE_ROWS, tiles = (n + tile - 1) / tile;
        #pragma omp parallel for schedule(static)
        for (Py_ssize_t t = 0; t < tiles; t++) {
            const Py_ssize_t r0 = t * tile, r1 = r0 + tile < n ? r0 + tile : n;
            if (m > 1 && use_vnni)
                q8_few_rows_vnni(type, c, raw_row, r0, r1, n * raw_row, &X, m, y, k, n);
            else if (m > 1)
                q8_few_rows_avx2(type, c, raw_row, r0, r1, n * raw_row, &X, m, y, k, n);
            else if (affine)
                q8_rows_affine_avx2(bits, group, c, scales, biases, factor, half, r0, r1, n * raw_row, &X, y, k);
            else if (use_vnni)
                q8_rows_vnni(type, c, raw_row, r0, r1, n * raw_row, &X, 1, y, k, n);
            else
                q8_rows_avx2(type, c, raw_row, r0, r1, n * raw_row, &X, 1, y, k, n);
        }
    }
    q8x_free(&X);
    return failed;
#else
    (void)bits, (void)x, (void)c, (void)scales, (void)biases, (void)factor, (void)half, (void)y, (void)m, (void)k,
        (void)n, (void)group;
    return 1;
#endif
}

/* y [m, n] = x @ W.T with x quantized (see the top of this file); W as gemv_run takes it (bits without Q8_FLAG).
 * Returns -1 when out of memory. */
int q8_run(int bits, const float *x, const uint8_t *c, const void *scales, const void *biases, float factor,
           int half, float *y, Py_ssize_t m, Py_ssize_t k, Py_ssize_t n, Py_ssize_t group) {
    if (m >= 1) { /* q8_vec says which row counts it takes */
        const int done = q8_vec(bits, x, c, scales, biases, factor, half, y, m, k, n, group);
        if (done <= 0) return done;
    }
    const int type = bits - FORM_BLOCKS;
    Py_ssize_t values = 1, block_bytes = 0;
    const int blocks = block_form(bits, &bits, &group, &values, &block_bytes);
    const Py_ssize_t row_bytes = bits == 4 ? k / 2 : k, groups = k / group,
                     raw_row = blocks ? k / values * block_bytes : row_bytes;
    /* the largest code: 4-bit forms 15, Q5's 31, Q6_K's 63; Q8_0's (q + 128) and 8-bit affine codes pass 127 */
    const int code_max = bits == 4 ? 15
                         : !blocks || type == GGML_Q8_0 ? 255
                         : type == GGML_Q6_K ? 63 : 31;
    struct q8x X;
    const Py_ssize_t chunk = m < Q8_CHUNK ? m : Q8_CHUNK;
    int failed = q8x_alloc(&X, group, k, chunk);
    Py_ssize_t tile = tile_rows(groups);
    if (blocks && tile * row_bytes > DECODED_BYTES) tile = DECODED_BYTES / row_bytes;
    const Py_ssize_t tiles = (n + tile - 1) / tile;
    for (Py_ssize_t i0 = 0; i0 < m && !failed; i0 += chunk) {
        const Py_ssize_t rows = m - i0 < chunk ? m - i0 : chunk;
        #pragma omp parallel
        {
            uint8_t *natural = malloc((size_t)X.kp); /* a row in column order, before q8_interleave */
            #pragma omp for schedule(static)
            for (Py_ssize_t j = 0; j < rows; j++) {
                if (natural) {
                    q8_quantize_row(x + (i0 + j) * k, k, &X, j, (int8_t *)natural);
                } else {
                    #pragma omp atomic write
                    failed = 1;
                }
            }
            uint8_t *wq = alloc64((size_t)(tile * X.kp)), *decoded = blocks ? alloc64(DECODED_BYTES) : NULL;
            float *wide_s = malloc(2 * TILE_GROUPS * sizeof(float)), *ws = alloc64((size_t)(2 * tile * X.lanes) * sizeof(float));
            const int ok = natural && wq && wide_s && ws && (!blocks || decoded);
            float *wb = ok ? ws + tile * X.lanes : NULL;
            #pragma omp for schedule(static)
            for (Py_ssize_t t = 0; t < tiles; t++) {
                if (!ok) { /* every thread still takes its share of the loop (a worksharing construct) */
                    #pragma omp atomic write
                    failed = 1;
                    continue;
                }
                const Py_ssize_t r0 = t * tile, r1 = r0 + tile < n ? r0 + tile : n;
                const float *s, *bi;
                const uint8_t *ct;
                if (blocks) {
                    decode_tile(type, c + r0 * raw_row, raw_row, r1 - r0, k, (n - r0) * raw_row, decoded, wide_s,
                                wide_s + TILE_GROUPS);
                    s = wide_s, bi = wide_s + TILE_GROUPS, ct = decoded;
                } else {
                    tile_scales(scales, biases, factor, half, r0, r1, groups, wide_s, &s, &bi);
                    ct = c + r0 * row_bytes;
                }
                for (Py_ssize_t r = 0; r < r1 - r0; r++) {
                    const uint8_t *cr = ct + r * row_bytes;
                    uint8_t *out = wq + r * X.kp;
                    Py_ssize_t left = k, room = X.kp;
#ifdef HAVE_X86
                    if (use_avx512 || use_avx2) { /* whole spans in registers; a last partial one below */
                        const Py_ssize_t span = group * Q8_LANES, whole = k / span;
                        q8_pack_spans_avx2(bits, cr, whole, group, out);
                        cr += whole * (bits == 4 ? span / 2 : span), out += whole * span;
                        left -= whole * span, room -= whole * span;
                    }
#endif
                    if (room) q8_pack_row(bits, cr, left, group, room, out, natural);
                    memcpy(ws + r * X.lanes, s + r * groups, (size_t)groups * sizeof(float));
                    memcpy(wb + r * X.lanes, bi + r * groups, (size_t)groups * sizeof(float));
                    for (Py_ssize_t g = groups; g < X.lanes; g++) ws[r * X.lanes + g] = wb[r * X.lanes + g] = 0.0f;
                }
                float *yt = y + i0 * n + r0;
#ifdef HAVE_X86
                if (use_vnni) {
                    q8_tile_vnni(wq, ws, wb, r1 - r0, &X, rows, yt, n);
                    continue;
                }
                if (use_avx2) {
                    q8_tile_avx2(wq, ws, wb, r1 - r0, &X, rows, yt, n, code_max);
                    continue;
                }
#endif
                q8_block_portable(wq, ws, wb, r1 - r0, &X, 0, rows, yt, n);
            }
            free(natural);
            free(wq);
            free(decoded);
            free(wide_s);
            free(ws);
        }
    }
    q8x_free(&X);
    return failed ? -1 : 0;
}
