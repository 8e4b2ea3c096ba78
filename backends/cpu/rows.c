/* Per-row elementwise ops of a decoder layer.
 *
 * One pass each over rows of float32, single-threaded (they are small). They
 * follow the numpy backend's float32 formulas step by step (built with
 * -ffp-contract=off, so no multiply-add is fused): rope is bit-identical to
 * numpy's; rms_norm differs only in the order of its sum of squares, and
 * layer_norm in the order of its two sums. */

#include "kernels.h"

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
void rms_rows(const float *xi, const float *wt, float *yo, Py_ssize_t rows, Py_ssize_t n, float eps,
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

/* LayerNorm row by row: mean and variance in float32 (sums in dot_f32's
 * order), then (x - mean) / sqrt(variance + eps), times w and plus b where
 * given (NULL: none), as the numpy backend's formula does it. */
void layer_rows(const float *xi, const float *w, const float *b, float *yo, Py_ssize_t rows, Py_ssize_t n,
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

/* The rotate-half form on the first 2 * half features of each head (x [t, heads,
 * d], c and s [t, half]); features past 2 * half are copied. */
void rope_rows(const float *xi, const float *c, const float *s, float *o, Py_ssize_t t, Py_ssize_t heads,
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
