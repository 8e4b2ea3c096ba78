/* Matrix-vector products on affine-quantized weights for the numpy backend.
 *
 * A weight W [n, k] is held as codes (4 bits, two per byte, the even column
 * of each pair in the low nibble; or 8 bits, one per byte) with a float32
 * scale and bias per group of 32 consecutive values of a row:
 *
 *     W[r, c] = scale[r, g] * code[r, c] + bias[r, g],    g = c / 32
 *
 * (infer.quantize.AffineTensor; every GGUF type with a group-of-32 affine form
 * maps onto it exactly). For activations x [m, k] this computes y = x @ W.T as
 *
 *     y[i, r] = sum_g scale[r, g] * sum_{c in g} code[r, c] * x[i, c]
 *             + sum_g bias[r, g] * sum_{c in g} x[i, c]
 *
 * in float32: the codes are read once per call (about a quarter of float32's
 * bytes for 4 bits), which is what bounds decoding. The result differs from
 * dequantize-then-BLAS only in the order of float32 additions.
 *
 * Also: dequantization into a caller's float32 buffer (for products with many
 * rows, where BLAS on the dequantized matrix is faster).
 *
 * The AVX2+FMA path is chosen at run time (__builtin_cpu_supports); other
 * CPUs take the portable loops. Rows of W are split across OpenMP threads when
 * built with OpenMP. The GIL is released while computing.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HAVE_X86 1
#include <immintrin.h>
#endif

#define GROUP 32
#define MAX_ROWS 8 /* activation rows handled together; more go in chunks */

/* x [m, k] regrouped per group of 32 for the 4-bit layout: the 16 even
 * columns, then the 16 odd ones (the order of the low and high nibbles). */
static void permute_pairs(const float *x, float *xp, Py_ssize_t m, Py_ssize_t k) {
    for (Py_ssize_t i = 0; i < m; i++) {
        for (Py_ssize_t g = 0; g < k; g += GROUP) {
            const float *src = x + i * k + g;
            float *dst = xp + i * k + g;
            for (int j = 0; j < GROUP / 2; j++) {
                dst[j] = src[2 * j];
                dst[GROUP / 2 + j] = src[2 * j + 1];
            }
        }
    }
}

static void group_sums(const float *x, float *xs, Py_ssize_t m, Py_ssize_t k) {
    Py_ssize_t groups = k / GROUP;
    for (Py_ssize_t i = 0; i < m; i++)
        for (Py_ssize_t g = 0; g < groups; g++) {
            float s = 0.0f;
            for (int j = 0; j < GROUP; j++) s += x[i * k + g * GROUP + j];
            xs[i * groups + g] = s;
        }
}

/* -- portable ----------------------------------------------------------------- */

static void row4_portable(const uint8_t *codes, const float *scales, const float *biases, const float *xp,
                          const float *xs, float *out, Py_ssize_t m, Py_ssize_t k, Py_ssize_t n) {
    Py_ssize_t groups = k / GROUP;
    for (Py_ssize_t i = 0; i < m; i++) {
        float acc = 0.0f, bacc = 0.0f;
        for (Py_ssize_t g = 0; g < groups; g++) {
            const uint8_t *b = codes + g * (GROUP / 2);
            const float *v = xp + i * k + g * GROUP;
            float t = 0.0f;
            for (int j = 0; j < GROUP / 2; j++) t += (float)(b[j] & 15) * v[j] + (float)(b[j] >> 4) * v[GROUP / 2 + j];
            acc += scales[g] * t;
            bacc += biases[g] * xs[i * groups + g];
        }
        out[i * n] = acc + bacc;
    }
}

static void row8_portable(const uint8_t *codes, const float *scales, const float *biases, const float *x,
                          const float *xs, float *out, Py_ssize_t m, Py_ssize_t k, Py_ssize_t n) {
    Py_ssize_t groups = k / GROUP;
    for (Py_ssize_t i = 0; i < m; i++) {
        float acc = 0.0f, bacc = 0.0f;
        for (Py_ssize_t g = 0; g < groups; g++) {
            const uint8_t *b = codes + g * GROUP;
            const float *v = x + i * k + g * GROUP;
            float t = 0.0f;
            for (int j = 0; j < GROUP; j++) t += (float)b[j] * v[j];
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
#define AVX2 __attribute__((target("avx2,fma")))

AVX2 static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

AVX2 static inline __m256 widen(__m128i bytes8) { /* the low 8 bytes as 8 floats */
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes8));
}

/* One activation row: two accumulators in registers, two groups per step
 * (the accumulator chain, not the loads, limits the loop otherwise). */
AVX2 static inline __m256 dot4(const uint8_t *codes, const float *v, __m128i low) {
    __m128i b = _mm_loadu_si128((const __m128i *)codes);
    __m128i lo = _mm_and_si128(b, low), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);
    __m256 t = _mm256_mul_ps(widen(lo), _mm256_loadu_ps(v));
    t = _mm256_fmadd_ps(widen(_mm_srli_si128(lo, 8)), _mm256_loadu_ps(v + 8), t);
    t = _mm256_fmadd_ps(widen(hi), _mm256_loadu_ps(v + 16), t);
    return _mm256_fmadd_ps(widen(_mm_srli_si128(hi, 8)), _mm256_loadu_ps(v + 24), t);
}

AVX2 static inline __m256 dot8(const uint8_t *c, const float *v) {
    __m128i b0 = _mm_loadu_si128((const __m128i *)c), b1 = _mm_loadu_si128((const __m128i *)(c + 16));
    __m256 t = _mm256_mul_ps(widen(b0), _mm256_loadu_ps(v));
    t = _mm256_fmadd_ps(widen(_mm_srli_si128(b0, 8)), _mm256_loadu_ps(v + 8), t);
    t = _mm256_fmadd_ps(widen(b1), _mm256_loadu_ps(v + 16), t);
    return _mm256_fmadd_ps(widen(_mm_srli_si128(b1, 8)), _mm256_loadu_ps(v + 24), t);
}

AVX2 static float one_row(int bits, const uint8_t *codes, const float *scales, const float *biases, const float *v,
                          const float *xs, Py_ssize_t k) {
    Py_ssize_t groups = k / GROUP, step = bits == 4 ? GROUP / 2 : GROUP, g = 0;
    const __m128i low = _mm_set1_epi8(15);
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    if (bits == 4) {
        for (; g + 1 < groups; g += 2) {
            a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(scales + g), dot4(codes + g * step, v + g * GROUP, low), a0);
            a1 = _mm256_fmadd_ps(_mm256_broadcast_ss(scales + g + 1),
                                 dot4(codes + (g + 1) * step, v + (g + 1) * GROUP, low), a1);
        }
        if (g < groups) a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(scales + g), dot4(codes + g * step, v + g * GROUP, low), a0);
    } else {
        for (; g + 1 < groups; g += 2) {
            a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(scales + g), dot8(codes + g * step, v + g * GROUP), a0);
            a1 = _mm256_fmadd_ps(_mm256_broadcast_ss(scales + g + 1), dot8(codes + (g + 1) * step, v + (g + 1) * GROUP), a1);
        }
        if (g < groups) a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(scales + g), dot8(codes + g * step, v + g * GROUP), a0);
    }
    float bacc = 0.0f;
    for (g = 0; g < groups; g++) bacc += biases[g] * xs[g];
    return hsum(_mm256_add_ps(a0, a1)) + bacc;
}

AVX2 static void row4_avx2(const uint8_t *codes, const float *scales, const float *biases, const float *xp,
                           const float *xs, float *out, Py_ssize_t m, Py_ssize_t k, Py_ssize_t n) {
    if (m == 1) {
        out[0] = one_row(4, codes, scales, biases, xp, xs, k);
        return;
    }
    Py_ssize_t groups = k / GROUP;
    __m256 acc[MAX_ROWS];
    for (Py_ssize_t i = 0; i < m; i++) acc[i] = _mm256_setzero_ps();
    const __m128i low = _mm_set1_epi8(15);
    for (Py_ssize_t g = 0; g < groups; g++) {
        __m128i b = _mm_loadu_si128((const __m128i *)(codes + g * (GROUP / 2)));
        __m128i lo = _mm_and_si128(b, low), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);
        __m256 w0 = widen(lo), w1 = widen(_mm_srli_si128(lo, 8));
        __m256 w2 = widen(hi), w3 = widen(_mm_srli_si128(hi, 8));
        __m256 s = _mm256_broadcast_ss(scales + g);
        for (Py_ssize_t i = 0; i < m; i++) {
            const float *v = xp + i * k + g * GROUP;
            __m256 t = _mm256_mul_ps(w0, _mm256_loadu_ps(v));
            t = _mm256_fmadd_ps(w1, _mm256_loadu_ps(v + 8), t);
            t = _mm256_fmadd_ps(w2, _mm256_loadu_ps(v + 16), t);
            t = _mm256_fmadd_ps(w3, _mm256_loadu_ps(v + 24), t);
            acc[i] = _mm256_fmadd_ps(s, t, acc[i]);
        }
    }
    for (Py_ssize_t i = 0; i < m; i++) {
        float bacc = 0.0f;
        for (Py_ssize_t g = 0; g < groups; g++) bacc += biases[g] * xs[i * groups + g];
        out[i * n] = hsum(acc[i]) + bacc;
    }
}

AVX2 static void row8_avx2(const uint8_t *codes, const float *scales, const float *biases, const float *x,
                           const float *xs, float *out, Py_ssize_t m, Py_ssize_t k, Py_ssize_t n) {
    if (m == 1) {
        out[0] = one_row(8, codes, scales, biases, x, xs, k);
        return;
    }
    Py_ssize_t groups = k / GROUP;
    __m256 acc[MAX_ROWS];
    for (Py_ssize_t i = 0; i < m; i++) acc[i] = _mm256_setzero_ps();
    for (Py_ssize_t g = 0; g < groups; g++) {
        const uint8_t *c = codes + g * GROUP;
        __m128i b0 = _mm_loadu_si128((const __m128i *)c), b1 = _mm_loadu_si128((const __m128i *)(c + 16));
        __m256 w0 = widen(b0), w1 = widen(_mm_srli_si128(b0, 8));
        __m256 w2 = widen(b1), w3 = widen(_mm_srli_si128(b1, 8));
        __m256 s = _mm256_broadcast_ss(scales + g);
        for (Py_ssize_t i = 0; i < m; i++) {
            const float *v = x + i * k + g * GROUP;
            __m256 t = _mm256_mul_ps(w0, _mm256_loadu_ps(v));
            t = _mm256_fmadd_ps(w1, _mm256_loadu_ps(v + 8), t);
            t = _mm256_fmadd_ps(w2, _mm256_loadu_ps(v + 16), t);
            t = _mm256_fmadd_ps(w3, _mm256_loadu_ps(v + 24), t);
            acc[i] = _mm256_fmadd_ps(s, t, acc[i]);
        }
    }
    for (Py_ssize_t i = 0; i < m; i++) {
        float bacc = 0.0f;
        for (Py_ssize_t g = 0; g < groups; g++) bacc += biases[g] * xs[i * groups + g];
        out[i * n] = hsum(acc[i]) + bacc;
    }
}
AVX2 static void rowf_avx2(const float *w, const float *x, float *out, Py_ssize_t m, Py_ssize_t k, Py_ssize_t n) {
    Py_ssize_t c;
    if (m == 1) {
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
        return;
    }
    __m256 acc[MAX_ROWS];
    for (Py_ssize_t i = 0; i < m; i++) acc[i] = _mm256_setzero_ps();
    for (c = 0; c + 8 <= k; c += 8) {
        __m256 wv = _mm256_loadu_ps(w + c);
        for (Py_ssize_t i = 0; i < m; i++) acc[i] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + i * k + c), acc[i]);
    }
    for (Py_ssize_t i = 0; i < m; i++) {
        float t = hsum(acc[i]);
        for (Py_ssize_t cc = c; cc < k; cc++) t += w[cc] * x[i * k + cc];
        out[i * n] = t;
    }
}
/* One row of codes to float32, group by group (even columns in the low nibbles). */
AVX2 static void dequant_row_avx2(int bits, const uint8_t *codes, const float *scales, const float *biases,
                                  float *out, Py_ssize_t k) {
    const __m128i low = _mm_set1_epi8(15);
    for (Py_ssize_t g = 0; g < k / GROUP; g++) {
        __m256 sc = _mm256_broadcast_ss(scales + g), b = _mm256_broadcast_ss(biases + g);
        float *o = out + g * GROUP;
        if (bits == 4) {
            __m128i v = _mm_loadu_si128((const __m128i *)(codes + g * (GROUP / 2)));
            /* interleave low and high nibbles back into column order */
            __m128i lo = _mm_and_si128(v, low), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low);
            __m128i c0 = _mm_unpacklo_epi8(lo, hi), c1 = _mm_unpackhi_epi8(lo, hi);
            _mm256_storeu_ps(o, _mm256_add_ps(_mm256_mul_ps(widen(c0), sc), b));
            _mm256_storeu_ps(o + 8, _mm256_add_ps(_mm256_mul_ps(widen(_mm_srli_si128(c0, 8)), sc), b));
            _mm256_storeu_ps(o + 16, _mm256_add_ps(_mm256_mul_ps(widen(c1), sc), b));
            _mm256_storeu_ps(o + 24, _mm256_add_ps(_mm256_mul_ps(widen(_mm_srli_si128(c1, 8)), sc), b));
        } else {
            const uint8_t *c = codes + g * GROUP;
            __m128i c0 = _mm_loadu_si128((const __m128i *)c), c1 = _mm_loadu_si128((const __m128i *)(c + 16));
            _mm256_storeu_ps(o, _mm256_add_ps(_mm256_mul_ps(widen(c0), sc), b));
            _mm256_storeu_ps(o + 8, _mm256_add_ps(_mm256_mul_ps(widen(_mm_srli_si128(c0, 8)), sc), b));
            _mm256_storeu_ps(o + 16, _mm256_add_ps(_mm256_mul_ps(widen(c1), sc), b));
            _mm256_storeu_ps(o + 24, _mm256_add_ps(_mm256_mul_ps(widen(_mm_srli_si128(c1, 8)), sc), b));
        }
    }
}
#endif

typedef void (*row_fn)(const uint8_t *, const float *, const float *, const float *, const float *, float *,
                       Py_ssize_t, Py_ssize_t, Py_ssize_t);

static int use_avx2 = 0;

/* -- Python ------------------------------------------------------------------- */

static int check(Py_buffer *b, Py_ssize_t want, const char *what) {
    if (b->len != want) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes, expected %zd", what, b->len, want);
        return 0;
    }
    return 1;
}

/* gemv(bits, x, codes, scales, biases, out, m, k, n) -> None
 * x float32 [m, k]; codes uint8 [n, k/2] (4 bits) or [n, k] (8 bits);
 * scales, biases float32 [n, k/32]; out float32 [m, n], written. */
static PyObject *gemv(PyObject *self, PyObject *args) {
    int bits;
    Py_buffer x, codes, scales, biases, out;
    Py_ssize_t m, k, n;
    if (!PyArg_ParseTuple(args, "iy*y*y*y*w*nnn", &bits, &x, &codes, &scales, &biases, &out, &m, &k, &n))
        return NULL;
    PyObject *result = NULL;
    float *work = NULL;
    if ((bits != 4 && bits != 8) || m < 1 || k < GROUP || k % GROUP || n < 1) {
        PyErr_Format(PyExc_ValueError, "bad shape or bits: bits=%d m=%zd k=%zd n=%zd", bits, m, k, n);
        goto done;
    }
    Py_ssize_t row_bytes = bits == 4 ? k / 2 : k, groups = k / GROUP;
    if (!check(&x, m * k * 4, "x") || !check(&codes, n * row_bytes, "codes") ||
        !check(&scales, n * groups * 4, "scales") || !check(&biases, n * groups * 4, "biases") ||
        !check(&out, m * n * 4, "out"))
        goto done;
    work = malloc((size_t)(m * k + m * groups) * sizeof(float));
    if (!work) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    float *xp = work, *xs = work + m * k;
    const float *xin = (const float *)x.buf;
    if (bits == 4) permute_pairs(xin, xp, m, k);
    else memcpy(xp, xin, (size_t)(m * k) * sizeof(float));
    group_sums(xin, xs, m, k);
    row_fn fn = bits == 4 ? row4_portable : row8_portable;
#ifdef HAVE_X86
    if (use_avx2) fn = bits == 4 ? row4_avx2 : row8_avx2;
#endif
    const uint8_t *c = (const uint8_t *)codes.buf;
    const float *s = (const float *)scales.buf, *bi = (const float *)biases.buf;
    float *y = (float *)out.buf;
    for (Py_ssize_t i0 = 0; i0 < m; i0 += MAX_ROWS) {
        Py_ssize_t rows = m - i0 < MAX_ROWS ? m - i0 : MAX_ROWS;
        #pragma omp parallel for schedule(static)
        for (Py_ssize_t r = 0; r < n; r++)
            fn(c + r * row_bytes, s + r * groups, bi + r * groups, xp + i0 * k, xs + i0 * groups, y + i0 * n + r,
               rows, k, n);
    }
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    free(work);
    PyBuffer_Release(&x);
    PyBuffer_Release(&codes);
    PyBuffer_Release(&scales);
    PyBuffer_Release(&biases);
    PyBuffer_Release(&out);
    return result;
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
    void (*fn)(const float *, const float *, float *, Py_ssize_t, Py_ssize_t, Py_ssize_t) = rowf_portable;
#ifdef HAVE_X86
    if (use_avx2) fn = rowf_avx2;
#endif
    const float *xin = (const float *)x.buf, *wt = (const float *)w.buf;
    float *y = (float *)out.buf;
    for (Py_ssize_t i0 = 0; i0 < m; i0 += MAX_ROWS) {
        Py_ssize_t rows = m - i0 < MAX_ROWS ? m - i0 : MAX_ROWS;
        #pragma omp parallel for schedule(static)
        for (Py_ssize_t r = 0; r < n; r++) fn(wt + r * k, xin + i0 * k, y + i0 * n + r, rows, k, n);
    }
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&x);
    PyBuffer_Release(&w);
    PyBuffer_Release(&out);
    return result;
}

/* dequantize(bits, codes, scales, biases, out, n, k[, parallel]) -> None: out
 * float32 [n, k] = scale * code + bias, the same float32 values as
 * AffineTensor.dequantize. parallel=0 keeps it on the calling thread: before a
 * BLAS call, OpenMP workers would compete with BLAS's spinning ones. */
static PyObject *dequantize(PyObject *self, PyObject *args) {
    int bits, parallel = 1;
    Py_buffer codes, scales, biases, out;
    Py_ssize_t n, k;
    if (!PyArg_ParseTuple(args, "iy*y*y*w*nn|p", &bits, &codes, &scales, &biases, &out, &n, &k, &parallel))
        return NULL;
    PyObject *result = NULL;
    if ((bits != 4 && bits != 8) || k < GROUP || k % GROUP || n < 1) {
        PyErr_Format(PyExc_ValueError, "bad shape or bits: bits=%d n=%zd k=%zd", bits, n, k);
        goto done;
    }
    Py_ssize_t row_bytes = bits == 4 ? k / 2 : k, groups = k / GROUP;
    if (!check(&codes, n * row_bytes, "codes") || !check(&scales, n * groups * 4, "scales") ||
        !check(&biases, n * groups * 4, "biases") || !check(&out, n * k * 4, "out"))
        goto done;
    Py_BEGIN_ALLOW_THREADS
    const uint8_t *c = (const uint8_t *)codes.buf;
    const float *s = (const float *)scales.buf, *bi = (const float *)biases.buf;
    float *y = (float *)out.buf;
    #pragma omp parallel for schedule(static) if (parallel)
    for (Py_ssize_t r = 0; r < n; r++) {
        const uint8_t *cr = c + r * row_bytes;
        float *yr = y + r * k;
#ifdef HAVE_X86
        if (use_avx2) {
            dequant_row_avx2(bits, cr, s + r * groups, bi + r * groups, yr, k);
            continue;
        }
#endif
        for (Py_ssize_t g = 0; g < groups; g++) {
            const float sc = s[r * groups + g], b = bi[r * groups + g];
            float *yg = yr + g * GROUP;
            if (bits == 4) {
                const uint8_t *cg = cr + g * (GROUP / 2);
                for (int j = 0; j < GROUP / 2; j++) {
                    yg[2 * j] = sc * (float)(cg[j] & 15) + b;
                    yg[2 * j + 1] = sc * (float)(cg[j] >> 4) + b;
                }
            } else {
                const uint8_t *cg = cr + g * GROUP;
                for (int j = 0; j < GROUP; j++) yg[j] = sc * (float)cg[j] + b;
            }
        }
    }
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&codes);
    PyBuffer_Release(&scales);
    PyBuffer_Release(&biases);
    PyBuffer_Release(&out);
    return result;
}

static PyObject *simd(PyObject *self, PyObject *noargs) {
    return PyUnicode_FromString(use_avx2 ? "avx2+fma" : "portable");
}

static PyObject *threads(PyObject *self, PyObject *noargs) {
#ifdef _OPENMP
    extern int omp_get_max_threads(void);
    return PyLong_FromLong(omp_get_max_threads());
#else
    return PyLong_FromLong(1);
#endif
}

/* use_simd(name) -> None: "portable" or "avx2+fma" (where the CPU has it), for tests. */
static PyObject *use_simd(PyObject *self, PyObject *arg) {
    const char *name = PyUnicode_AsUTF8(arg);
    if (!name) return NULL;
    if (strcmp(name, "portable") == 0) {
        use_avx2 = 0;
    } else if (strcmp(name, "avx2+fma") == 0) {
#ifdef HAVE_X86
        if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))) {
            PyErr_SetString(PyExc_ValueError, "this CPU has no AVX2+FMA");
            return NULL;
        }
        use_avx2 = 1;
#else
        PyErr_SetString(PyExc_ValueError, "built without the x86 path");
        return NULL;
#endif
    } else {
        PyErr_Format(PyExc_ValueError, "unknown code path %R (portable, avx2+fma)", arg);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"use_simd", use_simd, METH_O, "Choose the code path (\"portable\" or \"avx2+fma\"); for tests."},
    {"gemv", gemv, METH_VARARGS, "y = x @ W.T for an affine-quantized W (see the module source)."},
    {"gemv_f32", gemv_f32, METH_VARARGS, "y = x @ W.T for a float32 W with few rows of x."},
    {"dequantize", dequantize, METH_VARARGS, "W as float32 into a buffer."},
    {"simd", simd, METH_NOARGS, "The code path chosen for this CPU."},
    {"threads", threads, METH_NOARGS, "Threads a product may use (OpenMP), 1 without OpenMP."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_affine", NULL, -1, methods};

PyMODINIT_FUNC PyInit__affine(void) {
#ifdef HAVE_X86
    __builtin_cpu_init();
    use_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
    return PyModule_Create(&module);
}
