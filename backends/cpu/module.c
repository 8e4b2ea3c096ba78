/* The Python entry points of the CPU kernels (the module infer.backends.cpu._kernels;
 * backends/cpu/kernels.py is the one Python door to them), and the choice of
 * code path.
 *
 * Every entry point takes its arrays as buffers (PyArg_ParseTuple's "y*" and
 * "w*", or optional(): None for an absent one), checks each one's size against
 * the shape it was given (sizes_ok), computes without the GIL, and releases
 * them all (finish): each states only its shapes and its call. */

#include "kernels.h"

int use_avx2 = 0, use_avx512 = 0, use_vnni = 0;

/* -- arguments ------------------------------------------------------------------- */

/* `obj` as a buffer in *b (PyBUF_SIMPLE, or PyBUF_WRITABLE), or b->obj NULL for
 * None; 0 (an exception set) when neither. */
INLINE int optional(PyObject *obj, Py_buffer *b, int flags) {
    b->obj = NULL;
    b->buf = NULL;
    return obj == Py_None || PyObject_GetBuffer(obj, b, flags) == 0;
}

/* A buffer and the bytes it must hold; an `absent_ok` one may be absent (obj NULL: not checked). */
struct size {
    Py_buffer *b;
    Py_ssize_t want;
    const char *what;
    int absent_ok;
};
#define ABSENT_OK 1

/* Whether each buffer holds its bytes; else 0, with a ValueError naming the first that does not. */
INLINE int sizes_ok(const struct size *s, size_t count) {
    for (size_t i = 0; i < count; i++) {
        if (s[i].absent_ok && !s[i].b->obj) continue;
        if (s[i].b->len != s[i].want) {
            PyErr_Format(PyExc_ValueError, "%s: %zd bytes, expected %zd", s[i].what, s[i].b->len, s[i].want);
            return 0;
        }
    }
    return 1;
}
#define SIZES_OK(...) sizes_ok((const struct size[]){__VA_ARGS__}, \
                               sizeof((const struct size[]){__VA_ARGS__}) / sizeof(struct size))

/* The entry point's end: its buffers released (absent ones, obj NULL, skipped
 * here rather than by a call each), then None, or NULL where it failed (its
 * exception set). */
INLINE PyObject *finish(int ok, Py_buffer *const *views, size_t count) {
    for (size_t i = 0; i < count; i++)
        if (views[i]->obj) PyBuffer_Release(views[i]);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}
#define FINISH(ok, ...) finish(ok, (Py_buffer *const[]){__VA_ARGS__}, \
                               sizeof((Py_buffer *const[]){__VA_ARGS__}) / sizeof(Py_buffer *))

/* A ValueError for arguments the kernels do not take; 0 (for the chains of && below). */
#define REFUSE(...) (PyErr_Format(PyExc_ValueError, __VA_ARGS__), 0)

/* The shape checks shared by gemv and dequantize (shape_ok), scales and
 * biases float32 or, with half, float16; a block form's scales and biases
 * are in its blocks (any buffers passed are not read). */
static int codes_fit(int bits, Py_ssize_t group, int half, Py_ssize_t n, Py_ssize_t k, Py_buffer *codes,
                     Py_buffer *scales, Py_buffer *biases) {
    if (n < 1 || !shape_ok(bits, group, half, k, biases->obj != NULL))
        return REFUSE("bad shape, bits or group: bits=%d group=%zd n=%zd k=%zd", bits, group, n, k);
    int db;
    Py_ssize_t dg, values, block_bytes;
    if (block_form(bits, &db, &dg, &values, &block_bytes))
        return SIZES_OK({codes, n * (k / values) * block_bytes, "blocks"});
    Py_ssize_t size = half ? 2 : 4, groups = k / group;
    return SIZES_OK({codes, n * (bits == 4 ? k / 2 : k), "codes"}, {scales, n * groups * size, "scales"},
                    {biases, n * groups * size, "biases", ABSENT_OK});
}

/* -- products ----------------------------------------------------------------------- */

typedef int (*product_fn)(int, const float *, const uint8_t *, const void *, const void *, float, int, float *,
                          Py_ssize_t, Py_ssize_t, Py_ssize_t, Py_ssize_t);

/* The body of gemv and gemm: their arguments parsed and checked alike, then
 * ``run`` (gemv_run or tiled_run, one signature) on them; ``exact`` refuses
 * bits carrying Q8_FLAG. */
static PyObject *product(PyObject *args, product_fn run, int exact) {
    int bits, half = 0;
    Py_buffer x, codes, scales, biases = {0}, out;
    PyObject *bobj;
    Py_ssize_t m, k, n, group = GROUP;
    float factor = 0.0f;
    if (!PyArg_ParseTuple(args, "iy*y*y*Ow*nnn|npf", &bits, &x, &codes, &scales, &bobj, &out, &m, &k, &n, &group,
                          &half, &factor))
        return NULL;
    int ok = optional(bobj, &biases, PyBUF_SIMPLE) && (m >= 1 || REFUSE("bad shape: m=%zd", m)) &&
             (!exact || (bits & Q8_FLAG) == 0 || REFUSE("gemm is exact: bits without Q8_FLAG")) &&
             codes_fit(bits & ~Q8_FLAG, group, half, n, k, &codes, &scales, &biases) &&
             SIZES_OK({&x, m * k * 4, "x"}, {&out, m * n * 4, "out"});
    if (ok) {
        int failed;
        Py_BEGIN_ALLOW_THREADS
        failed = run(bits, (const float *)x.buf, (const uint8_t *)codes.buf, scales.buf, biases.buf, factor, half,
                     (float *)out.buf, m, k, n, group);
        Py_END_ALLOW_THREADS
        if (failed) ok = (PyErr_NoMemory(), 0);
    }
    return FINISH(ok, &x, &codes, &scales, &biases, &out);
}

/* gemv(bits, x, codes, scales, biases, out, m, k, n[, group, half, factor]) -> None
 * x float32 [m, k]; codes uint8 [n, k/2] (4 bits) or [n, k] (8 bits);
 * scales, biases [n, k/group], float32 (or float16 with half true), biases
 * None for factor * scales; out float32 [m, n], written. group: 32 (default),
 * or 16 for 8-bit codes. bits may be a block form (kernels.h) and carry Q8_FLAG. */
static PyObject *gemv(PyObject *self, PyObject *args) { return product(args, gemv_run, 0); }

/* gemm(bits, x, codes, scales, biases, out, m, k, n[, group, half, factor]) -> None:
 * gemv's arguments and result (bits without Q8_FLAG), computed by the tiled
 * kernel (tiled.c) for many rows of x: exact float32, each weight panel
 * decoded once for all of them. */
static PyObject *gemm(PyObject *self, PyObject *args) { return product(args, tiled_run, 1); }

/* gemv_f32(x, w, out, m, k, n) -> None: out [m, n] = x [m, k] @ w [n, k].T in
 * float32, for the few-row products of decoding, with the same threads as
 * gemv (mixing two thread pools, BLAS's and OpenMP's, on few cores makes each
 * wait for the other's spinning workers). */
static PyObject *gemv_f32(PyObject *self, PyObject *args) {
    Py_buffer x, w, out;
    Py_ssize_t m, k, n;
    if (!PyArg_ParseTuple(args, "y*y*w*nnn", &x, &w, &out, &m, &k, &n)) return NULL;
    int ok = ((m >= 1 && k >= 1 && n >= 1) || REFUSE("bad shape: m=%zd k=%zd n=%zd", m, k, n)) &&
             SIZES_OK({&x, m * k * 4, "x"}, {&w, n * k * 4, "w"}, {&out, m * n * 4, "out"});
    if (ok) {
        Py_BEGIN_ALLOW_THREADS
        gemvf_run((const float *)x.buf, (const float *)w.buf, (float *)out.buf, m, k, n);
        Py_END_ALLOW_THREADS
    }
    return FINISH(ok, &x, &w, &out);
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
    int ok = optional(bobj, &biases, PyBUF_SIMPLE) && codes_fit(bits, group, half, n, k, &codes, &scales, &biases) &&
             SIZES_OK({&out, n * k * 4, "out"});
    if (ok) {
        Py_BEGIN_ALLOW_THREADS
        /* Spans of rows across the threads: a tile's scales are widened (or its blocks decoded) once. */
        const Py_ssize_t span = 32;
        #pragma omp parallel for schedule(static) if (parallel)
        for (Py_ssize_t r0 = 0; r0 < n; r0 += span)
            dequant_rows(bits, (const uint8_t *)codes.buf, scales.buf, biases.buf, factor, half, r0,
                         r0 + span < n ? r0 + span : n, k, group, (float *)out.buf + r0 * k);
        Py_END_ALLOW_THREADS
    }
    return FINISH(ok, &codes, &scales, &biases, &out);
}

/* -- per-row ops (rows.c) ------------------------------------------------------------ */

/* rms_norm(x, weight or None, out, rows, n, eps[, residual, h]) -> None. With
 * residual and h: h = x + residual first (written), and out = rms_norm(h). */
static PyObject *rms_norm(PyObject *self, PyObject *args) {
    Py_buffer x, out, w = {0}, res = {0}, h = {0};
    PyObject *wobj, *robj = Py_None, *hobj = Py_None;
    Py_ssize_t rows, n;
    float eps;
    if (!PyArg_ParseTuple(args, "y*Ow*nnf|OO", &x, &wobj, &out, &rows, &n, &eps, &robj, &hobj)) return NULL;
    int ok = optional(wobj, &w, PyBUF_SIMPLE) && optional(robj, &res, PyBUF_SIMPLE) &&
             optional(robj == Py_None ? Py_None : hobj, &h, PyBUF_WRITABLE) &&
             ((rows >= 1 && n >= 1) || REFUSE("bad shape: rows=%zd n=%zd", rows, n)) &&
             SIZES_OK({&x, rows * n * 4, "x"}, {&out, rows * n * 4, "out"}, {&w, n * 4, "weight", ABSENT_OK},
                      {&res, rows * n * 4, "residual", ABSENT_OK}, {&h, rows * n * 4, "h", !res.obj});
    if (ok) {
        Py_BEGIN_ALLOW_THREADS
        rms_rows((const float *)x.buf, (const float *)w.buf, (float *)out.buf, rows, n, eps, (const float *)res.buf,
                 (float *)h.buf);
        Py_END_ALLOW_THREADS
    }
    return FINISH(ok, &x, &out, &w, &res, &h);
}

/* layer_norm(x, weight or None, bias or None, out, rows, n, eps) -> None; out
 * must not be x. */
static PyObject *layer_norm(PyObject *self, PyObject *args) {
    Py_buffer x, out, w = {0}, b = {0};
    PyObject *wobj, *bobj;
    Py_ssize_t rows, n;
    float eps;
    if (!PyArg_ParseTuple(args, "y*OOw*nnf", &x, &wobj, &bobj, &out, &rows, &n, &eps)) return NULL;
    int ok = optional(wobj, &w, PyBUF_SIMPLE) && optional(bobj, &b, PyBUF_SIMPLE) &&
             ((rows >= 1 && n >= 1) || REFUSE("bad shape: rows=%zd n=%zd", rows, n)) &&
             SIZES_OK({&x, rows * n * 4, "x"}, {&out, rows * n * 4, "out"}, {&w, n * 4, "weight", ABSENT_OK},
                      {&b, n * 4, "bias", ABSENT_OK}) &&
             (x.buf != out.buf || REFUSE("layer_norm: out must not be x"));
    if (ok) {
        Py_BEGIN_ALLOW_THREADS
        layer_rows((const float *)x.buf, (const float *)w.buf, (const float *)b.buf, (float *)out.buf, rows, n, eps);
        Py_END_ALLOW_THREADS
    }
    return FINISH(ok, &x, &out, &w, &b);
}

/* rope(x, cos, sin, out, tokens, heads, d, half) -> None: the rotate-half form on
 * the first 2*half features of each head (x [tokens, heads, d], cos and sin
 * [tokens, half]); features past 2*half are copied. */
static PyObject *rope(PyObject *self, PyObject *args) {
    Py_buffer x, cs, sn, out;
    Py_ssize_t t, heads, d, half;
    if (!PyArg_ParseTuple(args, "y*y*y*w*nnnn", &x, &cs, &sn, &out, &t, &heads, &d, &half)) return NULL;
    int ok = ((t >= 1 && heads >= 1 && half >= 0 && 2 * half <= d) ||
              REFUSE("bad shape: tokens=%zd heads=%zd d=%zd half=%zd", t, heads, d, half)) &&
             SIZES_OK({&x, t * heads * d * 4, "x"}, {&out, t * heads * d * 4, "out"}, {&cs, t * half * 4, "cos"},
                      {&sn, t * half * 4, "sin"});
    if (ok) {
        Py_BEGIN_ALLOW_THREADS
        rope_rows((const float *)x.buf, (const float *)cs.buf, (const float *)sn.buf, (float *)out.buf, t, heads, d,
                  half);
        Py_END_ALLOW_THREADS
    }
    return FINISH(ok, &x, &cs, &sn, &out);
}

/* `obj` as float32 rows [rows, n] in *b, their columns contiguous and the rows *stride floats apart
 * (PyBUF_STRIDES: the gate and up halves of a fused product are column slices, taken in place); 0 with a
 * ValueError when it is not that. */
static int float_rows(PyObject *obj, Py_buffer *b, Py_ssize_t rows, Py_ssize_t n, Py_ssize_t *stride,
                      const char *what) {
    b->obj = NULL;
    b->buf = NULL;
    if (PyObject_GetBuffer(obj, b, PyBUF_STRIDES | PyBUF_FORMAT) != 0) return 0;
    const char *f = b->format ? b->format : "B";
    const int single = f[0] == '<' || f[0] == '=' || f[0] == '@' ? f[1] == 'f' && !f[2] : f[0] == 'f' && !f[1];
    const int shaped = (b->ndim == 2 && b->shape[0] == rows && b->shape[1] == n) ||
                       (b->ndim == 1 && rows == 1 && b->shape[0] == n);
    *stride = b->ndim == 2 ? b->strides[0] / 4 : n;
    if (!single || b->itemsize != 4 || !shaped || b->strides[b->ndim - 1] != 4 ||
        (rows > 1 && (b->strides[0] % 4 || *stride < n)))
        return REFUSE("%s: not float32 rows [%zd, %zd] with contiguous columns", what, rows, n);
    return 1;
}

/* silu(x, up or None, out, rows, n[, act]) -> None: out [rows, n] (contiguous) = silu(x), or with act 1 GELU's
 * tanh form, times up where given (SwiGLU); x and up [rows, n] with contiguous columns, their rows anywhere apart
 * (unary.c). */
static PyObject *silu(PyObject *self, PyObject *args) {
    Py_buffer x, up = {0}, out;
    PyObject *xobj, *uobj;
    Py_ssize_t rows, n, xs = 0, us = 0;
    int act = ACT_SILU;
    if (!PyArg_ParseTuple(args, "OOw*nn|i", &xobj, &uobj, &out, &rows, &n, &act)) return NULL;
    x.obj = NULL;
    int ok = ((rows >= 1 && n >= 1) || REFUSE("bad shape: rows=%zd n=%zd", rows, n)) &&
             ((act == ACT_SILU || act == ACT_GELU_TANH) || REFUSE("unknown activation %d", act)) &&
             float_rows(xobj, &x, rows, n, &xs, "x") &&
             (uobj == Py_None || float_rows(uobj, &up, rows, n, &us, "up")) &&
             SIZES_OK({&out, rows * n * 4, "out"});
    if (ok) {
        Py_BEGIN_ALLOW_THREADS
        act_rows(act, (const float *)x.buf, xs, (const float *)up.buf, us, (float *)out.buf, rows, n, 1);
        Py_END_ALLOW_THREADS
    }
    return FINISH(ok, &x, &up, &out);
}

/* to_half(src, out, n) -> None: n float32 values of src rounded to IEEE float16
 * into out, by float_to_half: what a captured step's write into a float16 pool
 * computes (tests hold it to numpy's astype). */
static PyObject *to_half(PyObject *self, PyObject *args) {
    Py_buffer src, out;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "y*w*n", &src, &out, &n)) return NULL;
    int ok = (n >= 0 || REFUSE("bad shape: n=%zd", n)) && SIZES_OK({&src, n * 4, "src"}, {&out, n * 2, "out"});
    if (ok)
        for (Py_ssize_t i = 0; i < n; i++) ((uint16_t *)out.buf)[i] = float_to_half(((const float *)src.buf)[i]);
    return FINISH(ok, &src, &out);
}

/* q8_0(src, out, blocks) -> None: blocks * 32 float32 values of src into q8_0 blocks
 * (Q8_0_BYTES each) at out: the write into a kv_dtype="q8_0" pool (attention.c). */
static PyObject *q8_0(PyObject *self, PyObject *args) {
    Py_buffer src, out;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "y*w*n", &src, &out, &n)) return NULL;
    int ok = (n >= 0 || REFUSE("bad shape: blocks=%zd", n)) &&
             SIZES_OK({&src, n * 32 * 4, "src"}, {&out, n * Q8_0_BYTES, "out"});
    if (ok) {
        Py_BEGIN_ALLOW_THREADS
        q8_0_quantize((const float *)src.buf, (uint8_t *)out.buf, n);
        Py_END_ALLOW_THREADS
    }
    return FINISH(ok, &src, &out);
}

/* -- attention (attention.c) --------------------------------------------------------- */

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
 * IEEE float16 (read exactly as the float32 values they are); KV_Q8_0 (3): q8_0
 * blocks, dk/32 and dv/32 of them a row and head (attention.c).
 */
static PyObject *attention(PyObject *self, PyObject *args) {
    Py_buffer q, k, v, out, table = {0}, sinks = {0};
    Py_ssize_t tq, tk, hq, hkv, dk, dv, window, block = 0;
    float scale, softcap;
    int causal, parallel = 1, half = 0;
    PyObject *tobj = Py_None, *sobj = Py_None;
    if (!PyArg_ParseTuple(args, "y*y*y*w*nnnnnnfpnf|OnpOi", &q, &k, &v, &out, &tq, &tk, &hq, &hkv, &dk, &dv, &scale,
                          &causal, &window, &softcap, &tobj, &block, &parallel, &sobj, &half))
        return NULL;
    Py_ssize_t *rows = NULL; /* pool row of each key position */
    const int paged = tobj != Py_None;
    const int q8 = half == KV_Q8_0;
    const Py_ssize_t size = half ? 2 : 4; /* bytes of a stored key or value */
    int ok = (tq >= 1 && tk >= 1 && hq >= 1 && hkv >= 1 && hq % hkv == 0 && dk >= 1 && dv >= 1 &&
              (!paged || block >= 1) && (!q8 || (dk % 32 == 0 && dv % 32 == 0))) ||
             REFUSE("bad shape: tq=%zd tk=%zd hq=%zd hkv=%zd dk=%zd dv=%zd block=%zd", tq, tk, hq, hkv, dk, dv, block);
    /* Bytes of one row's keys and values per head: q8_0 blocks hold 32 values in Q8_0_BYTES. */
    const Py_ssize_t krow = q8 ? dk / 32 * Q8_0_BYTES : dk * size, vrow = q8 ? dv / 32 * Q8_0_BYTES : dv * size;
    /* Contiguous: k [tk, hkv, dk]. Paged: k and v are pools [blocks, block, hkv, d]
     * and the int64 table maps logical block b to its physical block. */
    const Py_ssize_t pool_rows = !ok ? 0 : paged ? k.len / (hkv * krow) : tk;
    ok = ok && optional(tobj, &table, PyBUF_SIMPLE) && optional(sobj, &sinks, PyBUF_SIMPLE) &&
         SIZES_OK({&q, tq * hq * dk * 4, "q"}, {&k, pool_rows * hkv * krow, "k"},
                  {&v, pool_rows * hkv * vrow, "v"}, {&out, tq * hq * dv * 4, "out"},
                  {&table, ((tk + block - 1) / (block ? block : 1)) * 8, "block table", ABSENT_OK},
                  {&sinks, hq * 4, "sinks", ABSENT_OK});
    if (ok) {
        rows = malloc((size_t)tk * sizeof(Py_ssize_t));
        if (!rows) ok = (PyErr_NoMemory(), 0);
    }
    for (Py_ssize_t j = 0; ok && j < tk; j++) {
        Py_ssize_t r = j;
        if (paged) {
            int64_t b = ((const int64_t *)table.buf)[j / block];
            r = (Py_ssize_t)b * block + j % block;
            if (b < 0 || r >= pool_rows) {
                PyErr_Format(PyExc_IndexError, "block table entry %lld is outside the pool of %zd blocks",
                             (long long)b, pool_rows / block);
                ok = 0;
            }
        }
        rows[j] = r;
    }
    if (ok) {
        Py_BEGIN_ALLOW_THREADS
        struct attend_args a = {(const float *)q.buf, k.buf, v.buf, (float *)out.buf, rows,
                                tq, tk, hq, hkv, dk, dv, window, scale, softcap, causal, half,
                                sinks.buf ? (const float *)sinks.buf : NULL};
        ok = attention_run(&a, parallel);
        Py_END_ALLOW_THREADS
        if (!ok) PyErr_NoMemory();
    }
    free(rows);
    return FINISH(ok, &table, &sinks, &q, &k, &v, &out);
}

/* -- the recurrent layers' ops (recurrent.c) ------------------------------------------- */

/* The ragged batch every recurrent op takes: query_start int32 [nseq + 1]
 * rising from 0 to T, checkpoint rows int32 [nrows] each one of the rows,
 * and order int64 [nrows], their indices sorted by row; else 0, a ValueError set. */
static int batch_ok(Py_buffer *qs, Py_buffer *rows, Py_buffer *order, Py_ssize_t nseq, Py_ssize_t nrows,
                    Py_ssize_t T) {
    if (nseq < 1 || nrows < 0) return REFUSE("bad batch: %zd sequences, %zd checkpoint rows", nseq, nrows);
    if (!SIZES_OK({qs, (nseq + 1) * 4, "query_start"}, {rows, nrows * 4, "checkpoint_rows"},
                  {order, nrows * 8, "order"}))
        return 0;
    const int32_t *q = (const int32_t *)qs->buf, *r = (const int32_t *)rows->buf;
    const int64_t *o = (const int64_t *)order->buf;
    if (q[0] != 0 || q[nseq] != T) return REFUSE("query_start must run from 0 to %zd", T);
    for (Py_ssize_t b = 0; b < nseq; b++)
        if (q[b + 1] < q[b]) return REFUSE("query_start falls at sequence %zd", b);
    for (Py_ssize_t i = 0; i < nrows; i++) {
        if (o[i] < 0 || o[i] >= nrows || r[o[i]] < 0 || r[o[i]] >= T || (i && r[o[i]] < r[o[i - 1]]))
            return REFUSE("checkpoint rows (or their order) are not rows of the batch");
    }
    return 1;
}

/* causal_conv1d(x, window, wt, bias, qs, rows, order, y, last, ckpt, nseq, nrows, T, C, K, silu) -> None:
 * x [T, C]; window [nseq, K - 1, C]; wt the weight transposed [K, C]; bias [C] or None;
 * y [T, C], last [nseq, K - 1, C], ckpt [nrows, K - 1, C] written. */
static PyObject *causal_conv1d(PyObject *self, PyObject *args) {
    Py_buffer x, win, wt, bias = {0}, qs, rows, order, y, last, ckpt;
    PyObject *bobj;
    Py_ssize_t nseq, nrows, T, C, K;
    int silu, parallel = 1;
    if (!PyArg_ParseTuple(args, "y*y*y*Oy*y*y*w*w*w*nnnnnp|p", &x, &win, &wt, &bobj, &qs, &rows, &order, &y, &last,
                          &ckpt, &nseq, &nrows, &T, &C, &K, &silu, &parallel))
        return NULL;
    int ok = optional(bobj, &bias, PyBUF_SIMPLE) &&
             ((T >= 0 && C >= 1 && K >= 1) || REFUSE("bad shape: T=%zd C=%zd K=%zd", T, C, K)) &&
             SIZES_OK({&x, T * C * 4, "x"}, {&win, nseq * (K - 1) * C * 4, "window"}, {&wt, K * C * 4, "weight"},
                      {&bias, C * 4, "bias", ABSENT_OK}, {&y, T * C * 4, "y"},
                      {&last, nseq * (K - 1) * C * 4, "last"}, {&ckpt, nrows * (K - 1) * C * 4, "ckpt"}) &&
             batch_ok(&qs, &rows, &order, nseq, nrows, T);
    if (ok) {
        Py_BEGIN_ALLOW_THREADS
        struct conv_args a = {x.buf, win.buf, wt.buf, bias.buf, qs.buf, rows.buf, order.buf, y.buf, last.buf,
                              ckpt.buf, nseq, nrows, C, K, silu, parallel};
        conv1d_run(&a);
        Py_END_ALLOW_THREADS
    }
    return FINISH(ok, &x, &win, &wt, &bias, &qs, &rows, &order, &y, &last, &ckpt);
}

/* gated_delta_rule(q, k, v, g, beta, state, qs, rows, order, o, last, ckpt, nseq, nrows, T, Hk, H, K, V,
 * scale, l2norm, chunked) -> None: q, k [T, Hk, K]; v [T, H, V]; g, beta [T, H]; state [nseq, H, K, V];
 * o [T, H, V], last [nseq, H, K, V], ckpt [nrows, H, K, V] written. Runs of at least `chunked`
 * rows take the chunked form (0: none). */
static PyObject *gated_delta_rule(PyObject *self, PyObject *args) {
    Py_buffer q, k, v, g, beta, state, qs, rows, order, o, last, ckpt;
    Py_ssize_t nseq, nrows, T, Hk, H, K, V, chunked;
    float scale;
    int l2norm, parallel = 1;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*y*y*y*y*w*w*w*nnnnnnnfpn|p", &q, &k, &v, &g, &beta, &state, &qs, &rows,
                          &order, &o, &last, &ckpt, &nseq, &nrows, &T, &Hk, &H, &K, &V, &scale, &l2norm, &chunked,
                          &parallel))
        return NULL;
    int ok = ((T >= 0 && Hk >= 1 && H >= 1 && H % Hk == 0 && K >= 1 && K <= GDR_MAX_K && V >= 1 && chunked >= 0) ||
              REFUSE("bad shape: T=%zd Hk=%zd H=%zd K=%zd (at most %d) V=%zd", T, Hk, H, K, GDR_MAX_K, V)) &&
             SIZES_OK({&q, T * Hk * K * 4, "q"}, {&k, T * Hk * K * 4, "k"}, {&v, T * H * V * 4, "v"},
                      {&g, T * H * 4, "g"}, {&beta, T * H * 4, "beta"}, {&state, nseq * H * K * V * 4, "state"},
                      {&o, T * H * V * 4, "o"}, {&last, nseq * H * K * V * 4, "last"},
                      {&ckpt, nrows * H * K * V * 4, "ckpt"}) &&
             batch_ok(&qs, &rows, &order, nseq, nrows, T);
    float *qn = NULL;
    if (ok && !(qn = malloc((size_t)(2 * T * Hk * K + 1) * 4))) ok = (PyErr_NoMemory(), 0);
    if (ok) {
        int failed;
        Py_BEGIN_ALLOW_THREADS
        float *kn = qn + T * Hk * K;
        gdr_prepare(q.buf, k.buf, qn, kn, T * Hk, K, scale, l2norm);
        struct gdr_args a = {qn, kn, v.buf, g.buf, beta.buf, state.buf, qs.buf, rows.buf, order.buf, o.buf,
                             last.buf, ckpt.buf, nseq, nrows, Hk, H, K, V, (int)chunked, parallel};
        failed = gdr_run(&a);
        Py_END_ALLOW_THREADS
        if (failed) ok = (PyErr_NoMemory(), 0);
    }
    free(qn);
    return FINISH(ok, &q, &k, &v, &g, &beta, &state, &qs, &rows, &order, &o, &last, &ckpt);
}

/* ssd(x, dt, A, B, C, D, dt_bias, state, qs, rows, order, y, last, ckpt, nseq, nrows, T, H, P, G, N,
 * softplus, dt_min, dt_max) -> None: x [T, H, P]; dt [T, H]; A [H]; B, C [T, G, N]; D, dt_bias [H]
 * or None; state [nseq, H, P, N]; y [T, H, P], last [nseq, H, P, N], ckpt [nrows, H, P, N] written. */
static PyObject *ssd(PyObject *self, PyObject *args) {
    Py_buffer x, dt, A, B, C, D = {0}, bias = {0}, state, qs, rows, order, y, last, ckpt;
    PyObject *dobj, *bobj;
    Py_ssize_t nseq, nrows, T, H, P, G, N;
    int softplus, parallel = 1;
    float lo, hi;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*OOy*y*y*y*w*w*w*nnnnnnnpff|p", &x, &dt, &A, &B, &C, &dobj, &bobj, &state,
                          &qs, &rows, &order, &y, &last, &ckpt, &nseq, &nrows, &T, &H, &P, &G, &N, &softplus, &lo,
                          &hi, &parallel))
        return NULL;
    int ok = optional(dobj, &D, PyBUF_SIMPLE) && optional(bobj, &bias, PyBUF_SIMPLE) &&
             ((T >= 0 && H >= 1 && P >= 1 && G >= 1 && H % G == 0 && N >= 1 && N <= SSD_MAX_N) ||
              REFUSE("bad shape: T=%zd H=%zd P=%zd G=%zd N=%zd (at most %d)", T, H, P, G, N, SSD_MAX_N)) &&
             SIZES_OK({&x, T * H * P * 4, "x"}, {&dt, T * H * 4, "dt"}, {&A, H * 4, "A"}, {&B, T * G * N * 4, "B"},
                      {&C, T * G * N * 4, "C"}, {&D, H * 4, "D", ABSENT_OK}, {&bias, H * 4, "dt_bias", ABSENT_OK},
                      {&state, nseq * H * P * N * 4, "state"}, {&y, T * H * P * 4, "y"},
                      {&last, nseq * H * P * N * 4, "last"}, {&ckpt, nrows * H * P * N * 4, "ckpt"}) &&
             batch_ok(&qs, &rows, &order, nseq, nrows, T);
    float *step = NULL;
    if (ok && !(step = malloc((size_t)(T * H + 1) * 4))) ok = (PyErr_NoMemory(), 0);
    if (ok) {
        Py_BEGIN_ALLOW_THREADS
        ssd_steps(dt.buf, bias.buf, step, T, H, softplus, lo, hi);
        struct ssd_args a = {x.buf, step, A.buf, B.buf, C.buf, D.buf, state.buf, qs.buf, rows.buf, order.buf,
                             y.buf, last.buf, ckpt.buf, nseq, nrows, H, P, G, N, parallel};
        ssd_run(&a);
        Py_END_ALLOW_THREADS
    }
    free(step);
    return FINISH(ok, &x, &dt, &A, &B, &C, &D, &bias, &state, &qs, &rows, &order, &y, &last, &ckpt);
}

/* -- the code path and the threads ----------------------------------------------------- */

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
static PyObject *simd(PyObject *self, PyObject *noargs) {
    return PyUnicode_FromString(use_avx512 ? "avx512" : use_avx2 ? "avx2+fma" : "portable");
}

static PyObject *threads(PyObject *self, PyObject *noargs) {
    return PyLong_FromLong(max_threads());
}

/* peak(kind, iterations) -> float: the multiply-adds one thread did in a loop of one instruction kind
 * ("vnni512": vpdpbusd on 64 byte pairs; "maddubs256": AVX2's vpmaddubsw + vpmaddwd + add on 32;
 * "fma512", "fma256": float32 fused multiply-adds), for the caller to time: the peaks
 * benchmarks/q8_gemm.py measures the products against. ValueError where this CPU lacks it. */
static PyObject *peak(PyObject *self, PyObject *args) {
    const char *kind;
    long iterations;
    if (!PyArg_ParseTuple(args, "sl", &kind, &iterations)) return NULL;
    if (iterations < 0) {
        PyErr_Format(PyExc_ValueError, "iterations must be at least 0, got %ld", iterations);
        return NULL;
    }
#ifdef HAVE_X86
    double done = -1.0;
    Py_BEGIN_ALLOW_THREADS
    if (strcmp(kind, "vnni512") == 0 && cpu_vnni()) done = peak_vnni512(iterations);
    else if (strcmp(kind, "maddubs256") == 0 && cpu_avx2()) done = peak_maddubs256(iterations);
    else if (strcmp(kind, "fma512") == 0 && cpu_avx512()) done = peak_fma512(iterations);
    else if (strcmp(kind, "fma256") == 0 && cpu_avx2()) done = peak_fma256(iterations);
    Py_END_ALLOW_THREADS
    if (done >= 0.0) return PyFloat_FromDouble(done);
#endif
    PyErr_Format(PyExc_ValueError, "no peak loop %R on this CPU (vnni512, maddubs256, fma512, fma256 where it has them)",
                 PyTuple_GET_ITEM(args, 0));
    return NULL;
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

static PyMethodDef methods[] = {
    {"use_simd", use_simd, METH_O, "Choose the code path (\"portable\", \"avx2+fma\" or \"avx512\")."},
    {"paths", paths, METH_NOARGS, "The code paths this CPU can run, best last."},
    {"block_forms", block_forms, METH_NOARGS, "GGML block types read as stored, and their forms."},
    {"gemv", gemv, METH_VARARGS, "y = x @ W.T for an affine-quantized W (see the module source)."},
    {"rms_norm", rms_norm, METH_VARARGS, "RMS norm of float32 rows (optionally after adding a residual)."},
    {"layer_norm", layer_norm, METH_VARARGS, "LayerNorm of float32 rows (optional weight and bias)."},
    {"rope", rope, METH_VARARGS, "Rotary embedding, rotate-half form, float32."},
    {"silu", silu, METH_VARARGS,
     "SiLU (SwiGLU with up), or GELU's tanh form, of float32 rows, in vectors on the kernels' threads."},
    {"to_half", to_half, METH_VARARGS, "Float32 to IEEE float16, rounded to nearest even (as a captured write)."},
    {"attention", attention, METH_VARARGS, "Attention for a few query rows, float32."},
    {"q8_0", q8_0, METH_VARARGS, "Float32 values into q8_0 blocks (a kv_dtype=\"q8_0\" pool's rows)."},
    {"gemm", gemm, METH_VARARGS, "y = x @ W.T for many rows of x, exact, on tiles of W decoded once (tiled.c)."},
    {"gemv_f32", gemv_f32, METH_VARARGS, "y = x @ W.T for a float32 W with few rows of x."},
    {"dequantize", dequantize, METH_VARARGS, "W as float32 into a buffer."},
    {"causal_conv1d", causal_conv1d, METH_VARARGS, "Depthwise causal convolution over a ragged batch, float32."},
    {"gated_delta_rule", gated_delta_rule, METH_VARARGS, "The gated delta rule over a ragged batch, float32."},
    {"ssd", ssd, METH_VARARGS, "Mamba2's state space scan over a ragged batch, float32."},
    {"run_plan", run_plan, METH_VARARGS, "Run a captured decode step's program (see plan.c)."},
    {"opcodes", opcodes, METH_NOARGS, "The programs' opcodes by name (see plan.c)."},
    {"simd", simd, METH_NOARGS, "The code path chosen for this CPU."},
    {"threads", threads, METH_NOARGS, "Threads a product may use (OpenMP), 1 without OpenMP."},
    {"peak", peak, METH_VARARGS, "Multiply-adds of a one-instruction peak loop, for the caller to time."},
    {"set_threads", set_threads, METH_O, "Set the threads the next products may use (OpenMP)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels", NULL, -1, methods};

PyMODINIT_FUNC PyInit__kernels(void) {
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
