/* Attention for the few query rows of decoding (module.c's attention, and
 * plan.c's captured steps): per query row and head, scores over the visible
 * keys, softmax, weighted sum of values, read from contiguous or paged pools of
 * float32 or float16 keys and values. */

#include "kernels.h"

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
void attention_run(const struct attend_args *a, float *scores, int parallel) {
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
