/* Attention for the few query rows of decoding (module.c's attention, and
 * plan.c's captured steps): per query row and head, scores over the visible
 * keys, softmax, weighted sum of values, read from contiguous or paged pools of
 * float32 or float16 keys and values, or of q8_0 blocks.
 *
 * One task is one query row and one key/value head with its query heads (the
 * grouped-query group, or a part of it when there are fewer tasks than threads),
 * so each key and value row is read from memory once for the group rather than
 * once per head. The keys are taken a tile at a time (Q8_0_TILE, fewer for wide
 * values) whose scores for the group stay in L1, with the running maximum and
 * sum of an online softmax: reading each row once for the group over a whole
 * row of scores per head was slower, the scores outgrew L1 (docs/performance.md).
 * Each head's arithmetic is its own, the same whichever heads share its task.
 *
 * Compiled three times, for the portable, the AVX2 and the AVX-512 path: the same
 * operations in the same order (no contraction into multiply-adds) on vectors of
 * sixteen floats, which each path holds in four, two or one registers, so all
 * three give the same bits. A score is sixteen lanes of products summed down the
 * columns, then the lanes added in one fixed tree (tree1), done for sixteen keys
 * at once by shuffles (tree16): summing each key's lanes on its own cost more
 * than the products (docs/performance.md, "Decode attention in sixteen lanes"). */

#include "kernels.h"

/* Eight floats as one value: GCC and clang compile it to one AVX register, or two
 * SSE ones, with the same per-lane arithmetic. */
typedef float v8f __attribute__((vector_size(32)));
/* The same, at any float's alignment: loads and stores through it keep the
 * accumulators in registers (a memcpy of their array made GCC keep it on the stack). */
typedef float v8f_u __attribute__((vector_size(32), aligned(4), may_alias));

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

/* The next tile's keys and values are asked for into L2, not L1 (prefetcht1): the
 * tasks walking their tiles together ask for more than L1 holds before they read
 * it back (16 tasks of 64 keys of 256 bytes), and asked into L1 (prefetcht0) they
 * evicted the rows being read. A float16 pool of the 1B shape, 16 layers' pools in
 * turn, two threads: 0.53-0.60x the time at 4,096 and 16,384 keys against prefetcht0
 * (docs/performance.md). -D to try others. */
#ifndef AHEAD_HINT
#define AHEAD_HINT 2
#endif
/* The scores and the weighted values work in v16f (kernels.h) on every path: the
 * same per-lane operations, so the same bits. */
typedef int32_t v8i __attribute__((vector_size(32)));

/* attend_args.half inside the AVX-512 instance: float16 rows converted sixteen at a time. */
#define KV_F16_512 4

#ifdef HAVE_X86
typedef long long v4di_u __attribute__((vector_size(32), aligned(1), may_alias));
/* AVX-512's vcvtph2ps on sixteen halves (asm, as kv8_f16c, and only in the AVX-512 instance). */
static inline __attribute__((always_inline)) v16f kv16_f16_512(const uint16_t *p) {
    v16f r;
    __asm__("vcvtph2ps %1, %0" : "=v"(r) : "m"(*(const v4di_u *)p));
    return r;
}
#endif

/* Sixteen stored values from element i of p (half as kv8 takes it, or KV_F16_512). */
static inline __attribute__((always_inline)) v16f kv16(const void *p, Py_ssize_t i, int half) {
    if (!half) return *(const v16f_u *)((const float *)p + i);
#ifdef HAVE_X86
    if (half == KV_F16_512) return kv16_f16_512((const uint16_t *)p + i);
#endif
    return __builtin_shufflevector(kv8(p, i, half), kv8(p, i + 8, half), 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,
                                   13, 14, 15);
}

/* Sixteen int8 codes as floats (exact), by vpmovsxbd on the x86 paths (path 2:
 * AVX2, 3: AVX-512): GCC 12 converts a vector of int8 one lane at a time. */
static inline __attribute__((always_inline)) v16f codes16(const int8_t *c, int path) {
#ifdef HAVE_X86
    if (path == 3) {
        v16i r;
        __asm__("vpmovsxbd %1, %0" : "=v"(r) : "m"(*(const v2di_u *)c));
        return __builtin_convertvector(r, v16f);
    }
    if (path == 2) {
        v8i lo, hi;
        __asm__("vpmovsxbd %1, %0" : "=x"(lo) : "m"(*(const long long *)c));
        __asm__("vpmovsxbd %1, %0" : "=x"(hi) : "m"(*(const long long *)(c + 8)));
        return __builtin_shufflevector(__builtin_convertvector(lo, v8f), __builtin_convertvector(hi, v8f), 0, 1, 2,
                                       3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    }
#endif
    v16f v;
    for (int t = 0; t < 16; t++) v[t] = (float)c[t];
    return v;
}

/* The first r (< 16) stored values from element i, zeros after them (a row's last columns). */
static inline __attribute__((always_inline)) v16f kv16_part(const void *p, Py_ssize_t i, Py_ssize_t r, int half) {
    v16f v = {0};
    for (Py_ssize_t t = 0; t < r; t++) v[t] = kv1(p, i + t, half);
    return v;
}

/* The sixteen lanes of a summed in one fixed tree: b_i = a_i + a_(i+8), c_i = b_i +
 * b_(i+4), d_i = c_i + c_(i+2), then d_0 + d_1. */
static inline __attribute__((always_inline)) float tree1(v16f a) {
    const v16f b = a + __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    const v16f c = b + __builtin_shufflevector(b, b, 4, 5, 6, 7, 0, 1, 2, 3, 8, 9, 10, 11, 12, 13, 14, 15);
    const v16f d = c + __builtin_shufflevector(c, c, 2, 3, 0, 1, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return d[0] + d[1];
}

/* tree1 of sixteen vectors at once, by pairwise shuffles and adds (three operations
 * per pair and level, where tree1 sixteen times would be four shuffles and adds per
 * vector and a lane extracted): lane l of the result is tree1(A[SLOT(l)]), every lane
 * the same additions in the same order as tree1's. */
#define SLOT(l) ((l) % 4 * 4 + (l) / 4)
#define SHUF(x, y, ...) __builtin_shufflevector(x, y, __VA_ARGS__)
static inline __attribute__((always_inline)) v16f tree16(const v16f *A) {
    v16f B[8], C[4], D[2];
    for (int k = 0; k < 8; k++)
        B[k] = SHUF(A[2 * k], A[2 * k + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               SHUF(A[2 * k], A[2 * k + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int k = 0; k < 4; k++)
        C[k] = SHUF(B[2 * k], B[2 * k + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               SHUF(B[2 * k], B[2 * k + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int k = 0; k < 2; k++)
        D[k] = SHUF(C[2 * k], C[2 * k + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
               SHUF(C[2 * k], C[2 * k + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
    return SHUF(D[0], D[1], 0, 2, 16, 18, 4, 6, 20, 22, 8, 10, 24, 26, 12, 14, 28, 30) +
           SHUF(D[0], D[1], 1, 3, 17, 19, 5, 7, 21, 23, 9, 11, 25, 27, 13, 15, 29, 31);
}
#undef SHUF

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

/* -- q8_0 pools (kv_dtype="q8_0") ---------------------------------------------------
 *
 * A pool row holds per 32 values one block of Q8_0_BYTES: an IEEE float16 scale d
 * then 32 int8 codes q, the values d * q (ggml's block_q8_0, as llama.cpp stores
 * its q8_0 cache). Writing rounds each 32 values x with d = max|x| / 127 and
 * q = rint(x * 127 / max|x|) (the rounding of the int8 activations, q8.c), d
 * kept as float16. Attending quantizes each query row the same way once per call,
 * with a float32 scale, so that Q·K is integer dot products per block:
 *
 *     s = sum_b (float)(sum_{t in b} qk_t * qq_t) * (dk_b * dq_b)   (in b's order)
 *
 * and reads values dequantized (d * q, one float32 multiply). A task is one query
 * row and one key/value head with its whole query group, so each key and value
 * row is read once for the group; the keys are taken Q8_0_TILE (or fewer, for
 * wide values) at a time, their scores for the group kept in L1, with the
 * running maximum and sum of an online softmax (the float path's two passes over
 * one head's scores outgrew L1 when four heads shared them: docs/performance.md).
 * The integer sums are exact and the float arithmetic after them one fixed
 * sequence, so the portable, AVX2 and AVX-512 VNNI paths give the same bits. */

/* n blocks of 32 floats from x into q8_0 blocks at out (the KV write). */
void q8_0_quantize(const float *x, uint8_t *out, Py_ssize_t blocks) {
    for (Py_ssize_t b = 0; b < blocks; b++, x += 32, out += Q8_0_BYTES) {
        float amax = 0.0f;
        for (int t = 0; t < 32; t++) {
            const float a = fabsf(x[t]);
            amax = a > amax ? a : amax;
        }
        const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        const uint16_t d = float_to_half(amax / 127.0f);
        memcpy(out, &d, 2);
        for (int t = 0; t < 32; t++) {
            const float v = rintf(x[t] * id);
            out[2 + t] = (uint8_t)(int8_t)(v > 127.0f ? 127 : v < -127.0f ? -127 : (int)v);
        }
    }
}

/* A query row of `blocks` blocks rounded alike: codes q, float32 scales d. */
void q8_0_query(const float *x, Py_ssize_t blocks, int8_t *q, float *d) {
    for (Py_ssize_t b = 0; b < blocks; b++, x += 32, q += 32) {
        float amax = 0.0f;
        for (int t = 0; t < 32; t++) {
            const float a = fabsf(x[t]);
            amax = a > amax ? a : amax;
        }
        const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        d[b] = amax / 127.0f;
        for (int t = 0; t < 32; t++) {
            const float v = rintf(x[t] * id);
            q[t] = (int8_t)(v > 127.0f ? 127 : v < -127.0f ? -127 : (int)v);
        }
    }
}

/* Raw scores (before the scale) of `heads` quantized query rows (q [heads][blocks *
 * 32], qd [heads][blocks]) against n key rows: s[g * stride + j]. The portable
 * form; x86/kvq8_x86.c has the AVX2 one, with the same sums. */
static void q8_0_scores(const uint8_t *const *keys, Py_ssize_t n, const int8_t *q, const float *qd, Py_ssize_t heads,
                        Py_ssize_t blocks, float *s, Py_ssize_t stride) {
    for (Py_ssize_t j = 0; j < n; j++) {
        for (Py_ssize_t g = 0; g < heads; g++) s[g * stride + j] = 0.0f;
        for (Py_ssize_t b = 0; b < blocks; b++) {
            const uint8_t *blk = keys[j] + b * Q8_0_BYTES;
            uint16_t h;
            memcpy(&h, blk, 2);
            const float kd = half_to_float(h);
            const int8_t *kq = (const int8_t *)(blk + 2);
            for (Py_ssize_t g = 0; g < heads; g++) {
                const int8_t *qq = q + (g * blocks + b) * 32;
                int32_t isum = 0;
                for (int t = 0; t < 32; t++) isum += (int32_t)kq[t] * (int32_t)qq[t];
                s[g * stride + j] += (float)isum * (kd * qd[g * blocks + b]);
            }
        }
    }
}

/* One task: query row i's heads h0..h0+G of key/value head kvh over the visible
 * keys [lo, hi), and what it carries from one tile of keys to the next. */
struct group_state {
    Py_ssize_t i, kvh, h0, G, lo, hi;
    int8_t *q;                   /* [group][dk] a q8_0 pool's query codes */
    float *qf, *qd, *o, *m, *l;  /* [group][dk16] the queries, zeros past dk; [group][dk/32] their q8_0 scales;
                                    [group][dv] sums; [group] running max and sum */
};

/* What a thread's tasks share, one tile at a time. */
struct group_work {
    float *s, *vt;         /* [group][tile] scores; [tile][dv] a q8_0 pool's values, dequantized */
    v16f *acc;             /* [group][16] the lanes of sixteen keys' scores, before tree16 */
    const uint8_t **keys;  /* [tile] a q8_0 pool's key rows */
};

static Py_ssize_t key_tile(Py_ssize_t dv) {
    Py_ssize_t t = 4096 / dv; /* a tile of dequantized values: 16 KiB */
    return t < 16 ? 16 : t > Q8_0_TILE ? Q8_0_TILE : t;
}

/* dk rounded up to whole vectors of sixteen: a query row's stride in group_state.qf. */
static Py_ssize_t dk16(Py_ssize_t dk) { return (dk + 15) / 16 * 16; }

/* A task's visible keys, its queries (a q8_0 pool's rounded once), and an empty softmax. */
static void group_begin(const struct attend_args *a, struct group_state *st) {
    const int q8 = a->half == KV_Q8_0;
    const Py_ssize_t pos = a->tk - a->tq + st->i, dk = a->dk, dv = a->dv, dkp = dk16(dk);
    st->lo = 0, st->hi = a->tk;
    if (a->causal) st->hi = pos + 1 < a->tk ? pos + 1 : a->tk;
    if (a->window > 0 && pos - a->window + 1 > st->lo) st->lo = pos - a->window + 1;
    if (a->window > 0 && !a->causal && pos + a->window < st->hi) st->hi = pos + a->window;
    for (Py_ssize_t g = 0; g < st->G; g++) {
        const float *qh = a->Q + (st->i * a->hq + st->h0 + g) * dk;
        if (q8) {
            q8_0_query(qh, dk / 32, st->q + g * dk, st->qd + g * (dk / 32));
        } else {
            memcpy(st->qf + g * dkp, qh, (size_t)dk * sizeof(float));
            for (Py_ssize_t c = dk; c < dkp; c++) st->qf[g * dkp + c] = 0.0f;
        }
        /* A sink is one more logit with no value: the softmax starts from it. */
        st->m[g] = a->sinks ? a->sinks[st->h0 + g] : -INFINITY;
        st->l[g] = a->sinks ? 1.0f : 0.0f;
        for (Py_ssize_t c = 0; c < dv; c++) st->o[g * dv + c] = 0.0f;
    }
}

/* The task's output: each head's sums over its softmax's total. */
static void group_end(const struct attend_args *a, const struct group_state *st) {
    const Py_ssize_t dv = a->dv;
    for (Py_ssize_t g = 0; g < st->G; g++) {
        float *out = a->O + (st->i * a->hq + st->h0 + g) * dv;
        for (Py_ssize_t c = 0; c < dv; c++) out[c] = st->hi > st->lo ? st->o[g * dv + c] / st->l[g] : 0.0f;
    }
}

/* Key j's place in the next tile: its key and value rows asked for (ahead[2j],
 * ahead[2j + 1]; NULL past the visible keys), a key at a time while the tasks beside
 * this one take their turns at the current tile. */
static inline __attribute__((always_inline)) void ask_ahead(const char *const *ahead, Py_ssize_t j, Py_ssize_t kbytes,
                                                            Py_ssize_t vbytes) {
    if (!ahead[2 * j]) return;
    for (Py_ssize_t b = 0; b < kbytes; b += 64) __builtin_prefetch(ahead[2 * j] + b, 0, AHEAD_HINT);
    for (Py_ssize_t b = 0; b < vbytes; b += 64) __builtin_prefetch(ahead[2 * j + 1] + b, 0, AHEAD_HINT);
}

/* Raw scores (before the scale) of the task's heads against the float32 or float16
 * key rows at elements key[0..n) of K: s[g * stride + j]. A head's score for a key
 * is sixteen lanes, lane l the products of columns c = l mod 16 summed in order
 * (the columns past dk are zeros in the query and the key, adding nothing), then
 * the lanes added in tree1's order; tree16 does the last step for sixteen keys
 * at once. Four heads share each load of a key row. */
static inline __attribute__((always_inline)) void float_scores(const float *qf, Py_ssize_t G, Py_ssize_t dk,
                                                               const void *K, const Py_ssize_t *key, Py_ssize_t n,
                                                               int half, v16f *acc, float *s, Py_ssize_t stride,
                                                               const char *const *ahead, Py_ssize_t kbytes,
                                                               Py_ssize_t vbytes) {
    const Py_ssize_t dkp = dk16(dk), full = dk / 16 * 16;
    for (Py_ssize_t j0 = 0; j0 < n; j0 += 16) {
        const Py_ssize_t m = n - j0 < 16 ? n - j0 : 16;
        for (Py_ssize_t l = 0; l < 16; l++) {
            v16f *A = acc + SLOT(l);
            if (l >= m) {
                for (Py_ssize_t g = 0; g < G; g++) A[g * 16] = (v16f){0};
                continue;
            }
            const Py_ssize_t ki = key[j0 + l];
            ask_ahead(ahead, j0 + l, kbytes, vbytes);
            Py_ssize_t g = 0;
            for (; g + 4 <= G; g += 4) {
                const float *q0 = qf + g * dkp, *q1 = q0 + dkp, *q2 = q1 + dkp, *q3 = q2 + dkp;
                v16f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
                Py_ssize_t c = 0;
                for (; c < full; c += 16) {
                    const v16f k = kv16(K, ki + c, half);
                    a0 += *(const v16f_u *)(q0 + c) * k, a1 += *(const v16f_u *)(q1 + c) * k;
                    a2 += *(const v16f_u *)(q2 + c) * k, a3 += *(const v16f_u *)(q3 + c) * k;
                }
                if (c < dk) {
                    const v16f k = kv16_part(K, ki + c, dk - c, half);
                    a0 += *(const v16f_u *)(q0 + c) * k, a1 += *(const v16f_u *)(q1 + c) * k;
                    a2 += *(const v16f_u *)(q2 + c) * k, a3 += *(const v16f_u *)(q3 + c) * k;
                }
                A[g * 16] = a0, A[(g + 1) * 16] = a1, A[(g + 2) * 16] = a2, A[(g + 3) * 16] = a3;
            }
            for (; g < G; g++) {
                const float *q0 = qf + g * dkp;
                v16f a0 = {0};
                Py_ssize_t c = 0;
                for (; c < full; c += 16) a0 += *(const v16f_u *)(q0 + c) * kv16(K, ki + c, half);
                if (c < dk) a0 += *(const v16f_u *)(q0 + c) * kv16_part(K, ki + c, dk - c, half);
                A[g * 16] = a0;
            }
        }
        for (Py_ssize_t g = 0; g < G; g++) {
            const v16f e = tree16(acc + g * 16);
            if (m == 16)
                *(v16f_u *)(s + g * stride + j0) = e;
            else
                for (Py_ssize_t l = 0; l < m; l++) s[g * stride + j0 + l] = e[l];
        }
    }
}

/* o_g[c] += p_g[j] v_j[c] over the tile's keys j in order, for each head g of the
 * task (four at a time sharing each load of a value row) and column c: each
 * column's sum is one chain in j, however the columns are blocked. */
static inline __attribute__((always_inline)) void weighted_values(const float *p, Py_ssize_t stride, Py_ssize_t G,
                                                                  Py_ssize_t dv, const void *V, const Py_ssize_t *row,
                                                                  Py_ssize_t n, int half, float *o) {
    Py_ssize_t g = 0;
    for (; g + 4 <= G; g += 4) {
        const float *p0 = p + g * stride, *p1 = p0 + stride, *p2 = p1 + stride, *p3 = p2 + stride;
        float *o0 = o + g * dv, *o1 = o0 + dv, *o2 = o1 + dv, *o3 = o2 + dv;
        Py_ssize_t c = 0;
        for (; c + 16 <= dv; c += 16) {
            v16f a0 = *(v16f_u *)(o0 + c), a1 = *(v16f_u *)(o1 + c), a2 = *(v16f_u *)(o2 + c), a3 = *(v16f_u *)(o3 + c);
            for (Py_ssize_t j = 0; j < n; j++) {
                const v16f v = kv16(V, row[j] + c, half);
                a0 += splat16(p0[j]) * v, a1 += splat16(p1[j]) * v, a2 += splat16(p2[j]) * v, a3 += splat16(p3[j]) * v;
            }
            *(v16f_u *)(o0 + c) = a0, *(v16f_u *)(o1 + c) = a1, *(v16f_u *)(o2 + c) = a2, *(v16f_u *)(o3 + c) = a3;
        }
        for (; c < dv; c++)
            for (Py_ssize_t j = 0; j < n; j++) {
                const float v = kv1(V, row[j] + c, half);
                o0[c] += p0[j] * v, o1[c] += p1[j] * v, o2[c] += p2[j] * v, o3[c] += p3[j] * v;
            }
    }
    for (; g < G; g++) {
        const float *p0 = p + g * stride;
        float *o0 = o + g * dv;
        Py_ssize_t c = 0;
        for (; c + 16 <= dv; c += 16) {
            v16f a0 = *(v16f_u *)(o0 + c);
            for (Py_ssize_t j = 0; j < n; j++) a0 += splat16(p0[j]) * kv16(V, row[j] + c, half);
            *(v16f_u *)(o0 + c) = a0;
        }
        for (; c < dv; c++)
            for (Py_ssize_t j = 0; j < n; j++) o0[c] += p0[j] * kv1(V, row[j] + c, half);
    }
}

/* The task's keys from t0 (a tile of them, those visible): scores, the online
 * softmax, the values' sums. half: 0 float32 rows, 1 float16 (portable conversion),
 * 2 float16 (F16C), KV_F16_512 float16 (AVX-512), KV_Q8_0 q8_0 blocks; path 2 is the
 * AVX2 instance and 3 the AVX-512 one (their q8_0 scores in x86/kvq8_x86.c). */
static inline __attribute__((always_inline)) void attend_tile(const struct attend_args *a, struct group_state *st,
                                                              struct group_work *w, Py_ssize_t t0, int half,
                                                              int path) {
    const int q8 = half == KV_Q8_0;
    const Py_ssize_t kvh = st->kvh, G = st->G, hi = st->hi;
    const Py_ssize_t dk = a->dk, dv = a->dv, hkv = a->hkv, T = key_tile(dv);
    const Py_ssize_t size = half ? 2 : 4, krow = q8 ? dk / 32 * Q8_0_BYTES : dk, vrow = q8 ? dv / 32 * Q8_0_BYTES : dv;
    const char *K = a->K, *V = a->V;
#define KEY(j) ((ROW(a, j) * hkv + kvh) * krow) /* element (q8_0: byte) index of key j's row */
#define VALUE(j) ((ROW(a, j) * hkv + kvh) * vrow)
    /* Rows hkv * dk apart, which the hardware prefetchers follow poorly: this head's keys
     * and values of the next tile, for ask_ahead (q8_0 rows are counted in bytes already). */
    const Py_ssize_t unit = q8 ? 1 : size, n = hi - t0 < T ? hi - t0 : T;
    Py_ssize_t key[Q8_0_TILE], row[Q8_0_TILE];
    const char *ahead[2 * Q8_0_TILE];
    for (Py_ssize_t j = 0; j < n; j++) {
        const int more = t0 + T + j < hi;
        ahead[2 * j] = more ? K + KEY(t0 + T + j) * unit : NULL;
        ahead[2 * j + 1] = more ? V + VALUE(t0 + T + j) * unit : NULL;
    }
    if (q8) {
        for (Py_ssize_t j = 0; j < n; j++) w->keys[j] = (const uint8_t *)K + KEY(t0 + j);
#ifdef HAVE_X86
        if (path == 3 && use_vnni)
            q8_0_scores_vnni(w->keys, n, st->q, st->qd, G, dk / 32, w->s, T);
        else if (path >= 2)
            q8_0_scores_avx2(w->keys, n, st->q, st->qd, G, dk / 32, w->s, T);
        else
#endif
            q8_0_scores(w->keys, n, st->q, st->qd, G, dk / 32, w->s, T);
    } else {
        for (Py_ssize_t j = 0; j < n; j++) key[j] = KEY(t0 + j);
        float_scores(st->qf, G, dk, K, key, n, half, w->acc, w->s, T, ahead, krow * unit, vrow * unit);
    }
    for (Py_ssize_t g = 0; g < G; g++) {
        float *s = w->s + g * T, top = st->m[g];
        if (a->softcap > 0.0f) {
            for (Py_ssize_t j = 0; j < n; j++) {
                float sc = s[j] * a->scale;
                sc = a->softcap * tanhf(sc / a->softcap);
                s[j] = sc;
                if (sc > top) top = sc;
            }
        } else { /* the largest, in any order: the same value */
            v16f most = splat16(top);
            Py_ssize_t j = 0;
            for (; j + 16 <= n; j += 16) {
                const v16f sc = *(v16f_u *)(s + j) * splat16(a->scale);
                *(v16f_u *)(s + j) = sc;
                const v16i more = sc > most;
                most = (v16f)(((v16i)sc & more) | ((v16i)most & ~more));
            }
            for (int l = 0; l < 16; l++)
                if (most[l] > top) top = most[l];
            for (; j < n; j++) {
                const float sc = s[j] * a->scale;
                s[j] = sc;
                if (sc > top) top = sc;
            }
        }
        const float corr = exp1_below(st->m[g] - top); /* the sums so far, rescaled to the new maximum */
        Py_ssize_t j = 0;
        for (; j + 8 <= n; j += 8) *(v8f_u *)(s + j) = exp8_below(*(v8f_u *)(s + j) - top);
        for (; j < n; j++) s[j] = exp1_below(s[j] - top);
        /* the total: sixteen lanes, key j in lane j mod 16, then tree1 */
        v16f lanes = {0};
        for (j = 0; j + 16 <= n; j += 16) lanes += *(v16f_u *)(s + j);
        if (j < n) {
            v16f rest = {0};
            for (Py_ssize_t l = 0; j + l < n; l++) rest[l] = s[j + l];
            lanes += rest;
        }
        st->l[g] = st->l[g] * corr + tree1(lanes);
        if (corr != 1.0f)
            for (Py_ssize_t c = 0; c < dv; c++) st->o[g * dv + c] *= corr;
        st->m[g] = top;
    }
    if (q8) { /* the tile's values, dequantized once for the group */
        for (Py_ssize_t j = 0; j < n; j++) {
            const uint8_t *vr = (const uint8_t *)V + VALUE(t0 + j);
            if (j + 4 < n) __builtin_prefetch((const uint8_t *)V + VALUE(t0 + j + 4), 0, 3);
            ask_ahead(ahead, j, krow * unit, vrow * unit);
            float *vt = w->vt + j * dv;
            for (Py_ssize_t b = 0; b < dv / 32; b++) {
                uint16_t h;
                memcpy(&h, vr + b * Q8_0_BYTES, 2);
                const v16f d = splat16(half_to_float(h));
                const int8_t *code = (const int8_t *)(vr + b * Q8_0_BYTES + 2);
                for (int c = 0; c < 32; c += 16) *(v16f_u *)(vt + b * 32 + c) = d * codes16(code + c, path);
            }
            row[j] = j * dv;
        }
        weighted_values(w->s, T, G, dv, w->vt, row, n, 0, st->o);
    } else {
        for (Py_ssize_t j = 0; j < n; j++) row[j] = VALUE(t0 + j);
        weighted_values(w->s, T, G, dv, V, row, n, half, st->o);
    }
#undef KEY
#undef VALUE
}

/* Compiled per path and per storage, so that each loop knows its loads. */
#define TILE_FN(name, half, path)                                                                                   \
    static void name(const struct attend_args *a, struct group_state *st, struct group_work *w, Py_ssize_t t0) {   \
        attend_tile(a, st, w, t0, half, path);                                                                     \
    }
TILE_FN(tile_portable, 0, 0)
TILE_FN(tile_portable_f16, 1, 0)
TILE_FN(tile_portable_q8_0, KV_Q8_0, 0)
#ifdef HAVE_X86
AVX2 static void tile_avx2(const struct attend_args *a, struct group_state *st, struct group_work *w, Py_ssize_t t0) {
    attend_tile(a, st, w, t0, 0, 2);
}
AVX2 static void tile_avx2_f16(const struct attend_args *a, struct group_state *st, struct group_work *w,
                               Py_ssize_t t0) {
    attend_tile(a, st, w, t0, 2, 2);
}
AVX2 static void tile_avx2_q8_0(const struct attend_args *a, struct group_state *st, struct group_work *w,
                                Py_ssize_t t0) {
    attend_tile(a, st, w, t0, KV_Q8_0, 2);
}
AVX512 static void tile_avx512(const struct attend_args *a, struct group_state *st, struct group_work *w, Py_ssize_t t0) {
    attend_tile(a, st, w, t0, 0, 3);
}
AVX512 static void tile_avx512_f16(const struct attend_args *a, struct group_state *st, struct group_work *w,
                                Py_ssize_t t0) {
    attend_tile(a, st, w, t0, KV_F16_512, 3);
}
AVX512 static void tile_avx512_q8_0(const struct attend_args *a, struct group_state *st, struct group_work *w,
                                 Py_ssize_t t0) {
    attend_tile(a, st, w, t0, KV_Q8_0, 3);
}
#endif

/* A thread's tasks sharing a query row (its key/value heads, in order) go tile by tile
 * together, up to this many: a pool row holds every key/value head's keys side by side,
 * and one head's pass over all the keys read a few hundred bytes of each row, a row
 * apart (a 1B model's float16 pool at 4k keys: 1.9x the time of reading the same bytes
 * contiguously). Each task's arithmetic is its own, tile for tile, so the bits are
 * those of one task at a time. */
#define TASKS_TOGETHER 16

/* Every (query row, key/value head) of a, each group split into parts when there
 * are fewer of those tasks than threads (a model with one key/value head), across
 * the OpenMP threads where parallel and the work is worth it, each thread a run of
 * consecutive tasks. 0 when out of memory; dk and dv must be multiples of 32 for
 * q8_0 blocks. */
int attention_run(const struct attend_args *a, int parallel) {
    typedef void (*tile_fn)(const struct attend_args *, struct group_state *, struct group_work *, Py_ssize_t);
    tile_fn fn = a->half == KV_Q8_0 ? tile_portable_q8_0 : a->half ? tile_portable_f16 : tile_portable;
#ifdef HAVE_X86
    if (use_avx2) fn = a->half == KV_Q8_0 ? tile_avx2_q8_0 : a->half ? tile_avx2_f16 : tile_avx2;
    if (use_avx512) fn = a->half == KV_Q8_0 ? tile_avx512_q8_0 : a->half ? tile_avx512_f16 : tile_avx512;
#endif
    const Py_ssize_t G = a->hq / a->hkv, T = key_tile(a->dv), rows = a->tq * a->hkv;
    const int go = parallel && rows * G > 1 && a->tk * a->dk >= 4096, threads = go ? max_threads() : 1;
    Py_ssize_t parts = rows >= threads ? 1 : (threads + rows - 1) / rows;
    if (parts > G) parts = G;
    const Py_ssize_t per = (G + parts - 1) / parts, tasks = rows * parts, dk = a->dk, dv = a->dv;
    int failed = 0;
    #pragma omp parallel if (go && tasks > 1) reduction(|: failed)
    {
        struct group_work w;
        struct group_state st[TASKS_TOGETHER];
        /* the shared score lanes; each task's queries, their scales, sums, maximum and total; the shared
         * scores and values */
        const size_t each = (size_t)(per * dk16(dk) + per * dk + per * dv + 2 * per), lanes = (size_t)per * 16 * 16;
        float *f = alloc64((lanes + (size_t)TASKS_TOGETHER * each + (size_t)(per * T + T * dv)) * sizeof(float));
        int8_t *codes = alloc64((size_t)(TASKS_TOGETHER * per * dk));
        w.keys = malloc((size_t)T * sizeof(*w.keys));
        if (!f || !codes || !w.keys) {
            failed = 1;
        } else {
            w.acc = (v16f *)f;
            for (int u = 0; u < TASKS_TOGETHER; u++) {
                float *e = f + lanes + u * each;
                st[u].qf = e, st[u].qd = e + per * dk16(dk), st[u].o = st[u].qd + per * dk;
                st[u].m = st[u].o + per * dv, st[u].l = st[u].m + per, st[u].q = codes + u * per * dk;
            }
            w.s = f + lanes + TASKS_TOGETHER * each, w.vt = w.s + per * T;
#ifdef _OPENMP
            const Py_ssize_t me = omp_get_thread_num(), team = omp_get_num_threads();
#else
            const Py_ssize_t me = 0, team = 1;
#endif
            const Py_ssize_t first = tasks * me / team, last = tasks * (me + 1) / team;
            for (Py_ssize_t t = first; t < last;) {
                int count = 0; /* the next tasks of one query row, set up */
                for (; t < last && count < TASKS_TOGETHER; t++) {
                    const Py_ssize_t row = t / parts, h = t % parts * per;
                    if (h >= G) continue;
                    if (count && row / a->hkv != st[0].i) break;
                    struct group_state *u = &st[count++];
                    u->i = row / a->hkv, u->kvh = row % a->hkv, u->h0 = row % a->hkv * G + h;
                    u->G = G - h < per ? G - h : per;
                    group_begin(a, u);
                }
                for (Py_ssize_t k = 0, more = 1; more; k++) { /* tile k of each */
                    more = 0;
                    for (int u = 0; u < count; u++) {
                        const Py_ssize_t t0 = st[u].lo + k * T;
                        if (t0 < st[u].hi) fn(a, &st[u], &w, t0), more = 1;
                    }
                }
                for (int u = 0; u < count; u++) group_end(a, &st[u]);
            }
        }
        free(f);
        free(codes);
        free(w.keys);
    }
    return !failed;
}
