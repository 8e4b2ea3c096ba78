/* SiLU, x / (1 + exp(-x)), and SwiGLU, silu(gate) * up, over float32 rows: the
 * activation of every gated MLP (Llama, Qwen, the hybrids' MLPs and gates), and
 * GELU's tanh form (Gemma's GeGLU, GPT-2) as x / (1 + exp(-2u)); eagerly for a
 * prompt's [tokens, intermediate] in one call split over the kernels' threads,
 * and in the captured decode step (plan.c's silu and gelu_tanh steps), so that a
 * prompt and the steps after it compute them alike.
 *
 * numpy computed it in five passes on one thread (negate, exp, add one, divide,
 * multiply): 1.3-1.5 ms a layer for a 1B model's 128-token prompt, [128, 8192],
 * while the kernels' other thread waited. Here it is one pass, sixteen lanes at
 * a time (eight on AVX2 and the portable path), on every thread.
 *
 * exp in vectors (exp16, exp8): t = k ln2 + r with k = round(t / ln2), the
 * product k ln2 in two parts (the first exact in float32), exp(r) for |r| <= ln2/2
 * by a polynomial of degree 7 (Cephes' expf coefficients, relative error 4e-9
 * on the interval), then times 2^k as two powers of two, so that every k of a
 * float32 result, subnormal or overflowing to inf, is reached by exact
 * multiplications but the last. SiLU is then within 2.3 ulp of its float64
 * value (tests/test_numpy_kernels.py). The operations are written on generic
 * vectors (v16f of kernels.h, v8f), unfused (-ffp-contract=off), so every path
 * gives the same bits; inputs past the range are clamped first (exp(-104) is below float32's
 * least subnormal, exp(89) above its largest value), NaN passes through. */

#include "kernels.h"

/* The vector helpers are always inlined: no call passes one, so GCC's note on their ABI does not apply. */
#pragma GCC diagnostic ignored "-Wpsabi"

/* The arithmetic is written once (UNARY_BODY) for vectors of W lanes: sixteen on
 * AVX-512 (one register), eight elsewhere (one AVX register, two SSE ones). GCC 12
 * built AVX2's sixteen-lane form through the stack, a lane at a time. Either width
 * runs the same operations on each lane, so the bits are the same. */
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));

static inline __attribute__((always_inline)) v8f splat8(float x) {
    const v8f v = {x};
    return __builtin_shufflevector(v, v, 0, 0, 0, 0, 0, 0, 0, 0);
}

/* t within [lo, hi], NaN kept. On x86 by vmaxps and vminps (asm, as attention.c's
 * codes16: intrinsics do not inline into the portable instance), which return
 * their second source where one is NaN: GCC lowered the generic comparison and
 * blend to a compare and a conditional move per lane. Elsewhere (and on the
 * portable path) the generic form. */
#ifdef HAVE_X86
#define REG16(x) "v"(x)
#define REG8(x) "x"(x)
#define MINMAX(REG)                                                                                                 \
    if (path >= 2) {                                                                                                \
        __asm__("vmaxps %1, %2, %0" : "=" REG(t) : REG(t), REG(l)); /* Intel order: max(l, t) */                    \
        __asm__("vminps %1, %2, %0" : "=" REG(t) : REG(t), REG(h));                                                 \
        return t;                                                                                                   \
    }
#else
#define MINMAX(REG) (void)path;
#endif
#define CLAMP(W, VF, VI, SPLAT, REG)                                                                                \
    static inline __attribute__((always_inline)) VF clamp##W(VF t, float lo, float hi, int path) {                  \
        const VF l = SPLAT(lo), h = SPLAT(hi);                                                                      \
        MINMAX(REG)                                                                                                 \
        const VI below = t < l, above = t > h; /* NaN compares false */                                             \
        t = (VF)(((VI)l & below) | ((VI)t & ~below));                                                               \
        return (VF)(((VI)h & above) | ((VI)t & ~above));                                                            \
    }

#define UNARY_BODY(W, VF, VI, VU, SPLAT)                                                                            \
    CLAMP(W, VF, VI, SPLAT, REG##W)                                                                                 \
    static inline __attribute__((always_inline)) VF exp##W(VF t, int path) {                                        \
        t = clamp##W(t, -104.0f, 89.0f, path);                                                                      \
        /* k: adding 1.5 * 2^23 rounds t / ln2 to an integer, which the sum's low bits then hold */                 \
        const VF magic = SPLAT(12582912.0f);                                                                        \
        const VF kf = t * SPLAT(1.44269504088896341f) + magic, k = kf - magic;                                      \
        /* ln2 = 0.693359375 (nine bits: k times it is exact) - 2.12194440e-4 */                                    \
        const VF r = (t - k * SPLAT(0.693359375f)) - k * SPLAT(-2.12194440e-4f);                                    \
        VF p = SPLAT(1.9875691500e-4f);                                                                             \
        p = p * r + SPLAT(1.3981999507e-3f);                                                                        \
        p = p * r + SPLAT(8.3334519073e-3f);                                                                        \
        p = p * r + SPLAT(4.1665795894e-2f);                                                                        \
        p = p * r + SPLAT(1.6666665459e-1f);                                                                        \
        p = p * r + SPLAT(5.0000001201e-1f);                                                                        \
        p = (p * (r * r) + r) + SPLAT(1.0f);                                                                        \
        /* 2^k as 2^k1 * 2^k2, k1 = floor(k / 2): each a normal float for k in [-150, 129] */                       \
        const VI ki = (VI)((VU)kf - (VU)magic), k1 = ki >> 1, k2 = ki - k1;                                         \
        const VF s1 = (VF)((VU)(k1 + 127) << 23), s2 = (VF)((VU)(k2 + 127) << 23);                                  \
        return (p * s1) * s2;                                                                                       \
    }                                                                                                               \
    static inline __attribute__((always_inline)) VF silu##W(VF x, int path) {                                       \
        return x / (SPLAT(1.0f) + exp##W(-x, path));                                                                \
    }                                                                                                               \
    /* 0.5 x (1 + tanh(u)) = x / (1 + exp(-2u)), u = sqrt(2 / pi) (x + 0.044715 x^3) as the numpy formula rounds it */ \
    static inline __attribute__((always_inline)) VF gelu##W(VF x, int path) {                                       \
        const VF u = SPLAT(0.7978845608028654f) * (x + ((SPLAT(0.044715f) * x) * x) * x);                           \
        return x / (SPLAT(1.0f) + exp##W(-(u + u), path));                                                          \
    }
UNARY_BODY(16, v16f, v16i, v16u, splat16)
UNARY_BODY(8, v8f, v8i, v8u, splat8)

/* Sixteen lanes of out = act(x) (times u unless NULL) from pointers at any float's alignment. */
static inline __attribute__((always_inline)) void act_vector(int act, const float *x, const float *u, float *o,
                                                            int path) {
    if (path == 3) {
        const v16f v = *(const v16f_u *)x;
        v16f y = act == ACT_GELU_TANH ? gelu16(v, path) : silu16(v, path);
        if (u) y *= *(const v16f_u *)u;
        *(v16f_u *)o = y;
        return;
    }
    typedef float v8f_u __attribute__((vector_size(32), aligned(4), may_alias));
    for (int h = 0; h < 16; h += 8) {
        const v8f v = *(const v8f_u *)(x + h);
        v8f y = act == ACT_GELU_TANH ? gelu8(v, path) : silu8(v, path);
        if (u) y *= *(const v8f_u *)(u + h);
        *(v8f_u *)(o + h) = y;
    }
}

/* Elements [f0, f1) of out [rows, n] (row-major, contiguous) = act(x) (times u
 * unless NULL), x's and u's rows xs and us floats apart. Elementwise: any split of
 * the elements gives the same bits. out may be x or u. */
static inline __attribute__((always_inline)) void act_span(int act, const float *x, Py_ssize_t xs, const float *u,
                                                          Py_ssize_t us, float *out, Py_ssize_t n, Py_ssize_t f0,
                                                          Py_ssize_t f1, int path) {
    for (Py_ssize_t f = f0; f < f1;) {
        const Py_ssize_t i = f / n, j1 = (i + 1) * n < f1 ? n : f1 - i * n;
        const float *xr = x + i * xs, *ur = u ? u + i * us : NULL;
        float *o = out + i * n;
        Py_ssize_t j = f - i * n;
        for (; j + 16 <= j1; j += 16) act_vector(act, xr + j, ur ? ur + j : NULL, o + j, path);
        if (j < j1) { /* the row's last values, in lanes of their own (zeros after them) */
            float a[16] = {0}, b[16] = {0}, y[16];
            const size_t bytes = (size_t)(j1 - j) * sizeof(float);
            memcpy(a, xr + j, bytes);
            if (ur) memcpy(b, ur + j, bytes);
            act_vector(act, a, ur ? b : NULL, y, path);
            memcpy(o + j, y, bytes);
        }
        f = i * n + j1;
    }
}

typedef void (*span_fn)(int, const float *, Py_ssize_t, const float *, Py_ssize_t, float *, Py_ssize_t, Py_ssize_t,
                        Py_ssize_t);

/* Each path's instance, the activation a constant in each branch. */
#define SPANS(path)                                                                                                 \
    if (act == ACT_GELU_TANH) act_span(ACT_GELU_TANH, x, xs, u, us, out, n, f0, f1, path);                          \
    else act_span(ACT_SILU, x, xs, u, us, out, n, f0, f1, path);

static void span_portable(int act, const float *x, Py_ssize_t xs, const float *u, Py_ssize_t us, float *out,
                          Py_ssize_t n, Py_ssize_t f0, Py_ssize_t f1) {
    SPANS(0)
}
#ifdef HAVE_X86
AVX2 static void span_avx2(int act, const float *x, Py_ssize_t xs, const float *u, Py_ssize_t us, float *out,
                           Py_ssize_t n, Py_ssize_t f0, Py_ssize_t f1) {
    SPANS(2)
}
AVX512 static void span_avx512(int act, const float *x, Py_ssize_t xs, const float *u, Py_ssize_t us, float *out,
                               Py_ssize_t n, Py_ssize_t f0, Py_ssize_t f1) {
    SPANS(3)
}
#endif

static span_fn span_path(void) {
#ifdef HAVE_X86
    if (use_avx512) return span_avx512;
    if (use_avx2) return span_avx2;
#endif
    return span_portable;
}

void act_rows(int act, const float *x, Py_ssize_t xs, const float *u, Py_ssize_t us, float *out, Py_ssize_t rows,
              Py_ssize_t n, int parallel) {
    const span_fn fn = span_path();
    const Py_ssize_t total = rows * n;
    if (!parallel || total < SILU_PARALLEL || max_threads() < 2) {
        fn(act, x, xs, u, us, out, n, 0, total);
        return;
    }
#ifdef _OPENMP
    #pragma omp parallel
    {
        /* each thread a run of whole vectors of the flat order (a run may start inside a row) */
        const Py_ssize_t t = omp_get_thread_num(), T = omp_get_num_threads(), vectors = (total + 15) / 16;
        const Py_ssize_t f0 = vectors * t / T * 16, f1 = t + 1 == T ? total : vectors * (t + 1) / T * 16;
        fn(act, x, xs, u, us, out, n, f0, f1);
    }
#endif
}
