/* The CPU kernels: the one header of the C sources in this folder, which
 * build one extension module (infer.backends.cpu._kernels; setup.py).
 *
 *   gemv.c              products on affine-quantized codes (y = x @ W.T), their
 *                       dequantization, float32 products: the portable rows and
 *                       the tile loop that picks a path per call
 *   blocks.c            GGML's blocks as a GGUF file stores them, decoded a tile
 *                       of rows at a time into the affine form
 *   q8.c                products with int8 activations (activations="q8")
 *   rows.c              per-row ops: rms_norm, layer_norm, rope
 *   attention.c         attention for the few query rows of decoding, over float
 *                       or q8_0 pools (and the q8_0 KV write)
 *   unary.c             SiLU and SwiGLU in vectors (the gated MLPs' activation)
 *   recurrent.c         the recurrent layers' ops: causal_conv1d, gated_delta_rule, ssd
 *   plan.c              the captured decode step's program runner (run_plan)
 *   module.c            the Python entry points and the choice of path
 *   x86/                the AVX2, AVX-512 and VNNI forms of the products, the
 *                       block decoders and q8 (x86/simd.h: their shared helpers)
 *
 * The code path is chosen at run time (__builtin_cpu_supports): AVX-512 (F, BW,
 * VL) where the CPU has it (the products only), else AVX2+FMA+F16C, else the
 * portable loops; use_simd() forces a lesser one (INFER_NUMPY_KERNELS, the
 * tests). Every path computes the same float32 sums in the same order where
 * the tests hold it to the same bits. Rows of W are split across OpenMP threads
 * when built with OpenMP; the GIL is released while computing.
 *
 * What the files share is here: the constants, the block forms, the float16
 * conversions (static inline, so a split file inlines them as the one file
 * did), and the functions one file calls in another, each declared once. */

#ifndef INFER_CPU_KERNELS_H
#define INFER_CPU_KERNELS_H

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

#define INLINE static inline __attribute__((always_inline))

#ifdef HAVE_X86
/* The x86 paths' functions are compiled for their instructions one by one, so
 * that the rest of the module runs on any x86-64 CPU. */
#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#define AVX512VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
#endif

#define WROWS 4 /* short 4-bit weight rows per step when decoding */
#define WIDE_ROW_BYTES 384 /* 4-bit rows up to 768 columns */

/* The code path: portable C loops, AVX2+FMA+F16C, or AVX-512 F+BW+VL (on top of AVX2,
 * which its elementwise ops, attention and dequantization keep using), and VNNI
 * on top of AVX-512 for q8's integer products (module.c sets them). */
extern int use_avx2, use_avx512, use_vnni;

/* -- float16 ------------------------------------------------------------------- */

/* IEEE half to float, exactly (subnormals, infinities and NaNs included). */
static inline float half_to_float(uint16_t h) {
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
static inline uint16_t float_to_half(float f) {
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

/* -- block forms: GGML's blocks as stored (blocks.c) ------------------------------ */

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
static inline int block_form(int form, int *bits, Py_ssize_t *group, Py_ssize_t *values, Py_ssize_t *bytes) {
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

/* Whether blocks_row_512 and blocks_row_avx2 compute this type (all eight block forms). */
static inline int direct_512(int type) {
    return type == GGML_Q4_0 || type == GGML_Q4_1 || type == GGML_Q4_K || type == GGML_Q5_K || type == GGML_Q6_K ||
           type == GGML_Q5_0 || type == GGML_Q5_1 || type == GGML_Q8_0;
}
static inline int direct_avx2(int type) { return direct_512(type); }

/* -- quantized activations (q8.c) --------------------------------------------------- */

#define Q8_FLAG (1 << 16)  /* or'ed into gemv's bits: quantize the activations */
#define Q8_LANES 16
#define Q8_CHUNK 128 /* activation rows quantized, then multiplied with each tile, at a time */
#ifndef Q8_FEW /* up to this many activation rows, AVX2 decodes each weight row once for all of them (-D to try others) */
#define Q8_FEW 5
#endif
/* Up to this many activation rows, AVX-512 VNNI runs its one-row kernel for each in turn (weights in blocks of
 * 32; Q8_FEW_VNNI_K for the K types), tiles past it (-D to try others; docs/performance.md). */
#ifndef Q8_FEW_VNNI
#define Q8_FEW_VNNI 4
#endif
#ifndef Q8_FEW_VNNI_K
#define Q8_FEW_VNNI_K 2
#endif

struct q8x {
    Py_ssize_t group, groups, spans, lanes, kp; /* groups a row; lanes = spans * 16 (the last span padded); kp = lanes * group bytes */
    int8_t *q;                          /* [rows][kp] interleaved */
    float *dx, *xs;                     /* [rows][lanes]: each group's scale (its 32 values'), dx * sum of q */
    int32_t *qs;                        /* [rows][lanes]: each group's sum of q (AVX2's signed codes) */
};

/* -- attention (attention.c) ----------------------------------------------------- */

struct attend_args {
    const float *Q;
    const void *K, *V; /* float32, or IEEE float16 where half */
    float *O;
    const Py_ssize_t *rows; /* pool row of each key position; NULL: position j is row j */
    Py_ssize_t tq, tk, hq, hkv, dk, dv, window;
    float scale, softcap;
    int causal, half; /* half: 0 float32, 1 IEEE float16, KV_Q8_0 q8_0 blocks (attention.c) */
    const float *sinks; /* [hq]: one more logit per head in each softmax, with no value; NULL: none */
};

/* -- q8_0 KV pools (attention.c) ------------------------------------------------------------ */

/* attend_args.half of a pool of q8_0 blocks (kv_dtype="q8_0"): per 32 values of a
 * row, a float16 scale d then 32 int8 codes q, the values d * q (ggml's block_q8_0). */
#define KV_Q8_0 3
#define Q8_0_BYTES 34
#define Q8_0_TILE 64 /* keys attended at a time (attention.c): a group's scores stay in L1 */

/* The threads a parallel loop may use (OpenMP's; 1 without OpenMP). */
/* Memory the vector kernels load from in 64-byte operations, on a cache line's start: a 512-bit load at
 * malloc's 16-byte alignment spans two lines three times in four, and on a Zen 4 the int8 tile kernel ran at
 * 0.87x its speed with both operands so placed (docs/performance.md, "Operands on cache lines"). The size is
 * rounded up to the alignment, as aligned_alloc asks. Freed with free(). */
static inline void *alloc64(size_t bytes) { return aligned_alloc(64, (bytes + 63) / 64 * 64); }

/* Sixteen floats as one value (one AVX-512 register, two AVX ones, four SSE ones), and at any float's
 * alignment: code written on these compiles to the same per-lane operations on every path (the function's
 * target attribute picks the registers), so it gives the same bits on each (attention.c, unary.c). */
typedef float v16f __attribute__((vector_size(64)));
typedef float v16f_u __attribute__((vector_size(64), aligned(4), may_alias));
typedef int32_t v16i __attribute__((vector_size(64)));

/* always inlined, so no call passes a v16f: GCC's note that such calls changed ABI does not apply */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"
static inline __attribute__((always_inline)) v16f splat16(float x) {
    const v16f v = {x}; /* a shuffle of lane 0, not an initializer of sixteen x: GCC built that lane by lane */
    return __builtin_shufflevector(v, v, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
}
#pragma GCC diagnostic pop

static inline int max_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

typedef void (*row_fn)(const uint8_t *, const float *, const float *, const float *, const float *, float *,
                       Py_ssize_t, Py_ssize_t, Py_ssize_t, Py_ssize_t);

/* -- what one file calls in another -------------------------------------------- */

/* gemv.c */
int shape_ok(int bits, Py_ssize_t group, int half, Py_ssize_t k, int biased);
Py_ssize_t tile_rows(Py_ssize_t groups);
void tile_scales(const void *scales, const void *biases, float factor, int half, Py_ssize_t r0, Py_ssize_t r1,
                 Py_ssize_t groups, float *wide, const float **s, const float **b);
int gemv_run(int bits, const float *x, const uint8_t *c, const void *scales, const void *biases, float factor,
             int half, float *y, Py_ssize_t m, Py_ssize_t k, Py_ssize_t n, Py_ssize_t group);
void dequant_rows(int bits, const uint8_t *c, const void *scales, const void *biases, float factor, int half,
                  Py_ssize_t r0, Py_ssize_t r1, Py_ssize_t k, Py_ssize_t group, float *y);
void gemvf_run(const float *xin, const float *wt, float *y, Py_ssize_t m, Py_ssize_t k, Py_ssize_t n);

/* blocks.c */
void decode_tile(int type, const uint8_t *raw, Py_ssize_t raw_row, Py_ssize_t rows, Py_ssize_t k, Py_ssize_t left,
                 uint8_t *codes, float *s, float *bi);

/* q8.c */
int q8_run(int bits, const float *x, const uint8_t *c, const void *scales, const void *biases, float factor,
           int half, float *y, Py_ssize_t m, Py_ssize_t k, Py_ssize_t n, Py_ssize_t group);

/* rows.c */
void rms_rows(const float *xi, const float *wt, float *yo, Py_ssize_t rows, Py_ssize_t n, float eps,
              const float *res, float *h);
void layer_rows(const float *xi, const float *w, const float *b, float *yo, Py_ssize_t rows, Py_ssize_t n,
                float eps);
void rope_rows(const float *xi, const float *c, const float *s, float *o, Py_ssize_t t, Py_ssize_t heads,
               Py_ssize_t d, Py_ssize_t half);

/* unary.c: out [rows, n] = act(x) (times u unless NULL), act SiLU or GELU's tanh form, x's and u's rows xs and
 * us floats apart; split over the threads where parallel and there are at least SILU_PARALLEL values (a thread's
 * wake-up costs more than a decode step's few thousand: 8,192 values take about 2 us on one core). */
enum { ACT_SILU, ACT_GELU_TANH };
#define SILU_PARALLEL 32768
void act_rows(int act, const float *x, Py_ssize_t xs, const float *u, Py_ssize_t us, float *out, Py_ssize_t rows,
              Py_ssize_t n, int parallel);

/* attention.c */
int attention_run(const struct attend_args *a, int parallel);
void q8_0_quantize(const float *x, uint8_t *out, Py_ssize_t blocks);
void q8_0_query(const float *x, Py_ssize_t blocks, int8_t *q, float *d);

/* recurrent.c: the arguments of each op (a ragged batch: query_start qs [nseq + 1],
 * checkpoint rows [nrows] and their indices in row order, `order`) */
#define GDR_MAX_K 256 /* widest key head gated_delta_rule takes */
#define SSD_MAX_N 256 /* largest state size ssd takes */
struct conv_args {
    const float *x, *window, *wt, *bias; /* wt: the weight transposed, [K][C] */
    const int32_t *qs, *rows;
    const int64_t *order;
    float *y, *last, *ckpt;
    Py_ssize_t nseq, nrows, C, K;
    int silu;
    int parallel; /* 0: on the calling thread (after BLAS products, whose spinning threads OpenMP's would fight) */
};

struct gdr_args {
    const float *q, *k; /* [T, Hk, K]: normalized and q scaled (gdr_prepare) */
    const float *v, *g, *beta, *state; /* [T, H, V], [T, H], [T, H], [B, H, K, V] */
    const int32_t *qs, *rows;
    const int64_t *order;
    float *o, *last, *ckpt;
    Py_ssize_t nseq, nrows, Hk, H, K, V;
    int chunked; /* rows a run needs to take the chunked form (0: never) */
    int parallel;
    const int32_t *slots; /* sequence b's rows of state and last: slots[b] (NULL: b); the two may be one
                             array, updated in place (each task reads its block before writing it) */
};

struct ssd_args {
    const float *x, *step, *A, *B, *C, *D, *state; /* step: dt after bias, softplus and clamp [T, H] */
    const int32_t *qs, *rows;
    const int64_t *order;
    float *y, *last, *ckpt;
    Py_ssize_t nseq, nrows, H, P, G, N;
    int parallel;
    const int32_t *slots; /* as gdr_args' */
};
void conv1d_run(const struct conv_args *a);
int gdr_run(const struct gdr_args *a);
void gdr_prepare(const float *q, const float *k, float *qn, float *kn, Py_ssize_t rows, Py_ssize_t K, float scale,
                 int l2norm);
void ssd_run(const struct ssd_args *a);
int recurrent_batch(const int32_t *qs, Py_ssize_t nseq, Py_ssize_t T, const int32_t *rows, Py_ssize_t nrows,
                    int64_t *order);
void ssd_steps(const float *dt, const float *bias, float *step, Py_ssize_t T, Py_ssize_t H, int softplus, float lo,
               float hi);

/* plan.c */
PyObject *run_plan(PyObject *self, PyObject *args);
PyObject *opcodes(PyObject *self, PyObject *noargs);

#ifdef HAVE_X86
/* x86/gemv_avx2.c */
AVX2 void row4_avx2(const uint8_t *codes, const float *scales, const float *biases, const float *x, const float *xs,
                    float *out, Py_ssize_t m, Py_ssize_t k, Py_ssize_t n, Py_ssize_t group);
AVX2 void row8_avx2(const uint8_t *codes, const float *scales, const float *biases, const float *x, const float *xs,
                    float *out, Py_ssize_t m, Py_ssize_t k, Py_ssize_t n, Py_ssize_t group);
AVX2 void rowf_avx2(const float *w, const float *x, float *out, Py_ssize_t m, Py_ssize_t k, Py_ssize_t n);
AVX2 void dequant_row_avx2(int bits, const uint8_t *codes, const float *scales, const float *biases, float *out,
                           Py_ssize_t k, Py_ssize_t group);
AVX2 void halves_f16c(const uint16_t *h, float *f, Py_ssize_t n);

/* x86/gemv_avx512.c */
AVX512 void row4_avx512(const uint8_t *codes, const float *scales, const float *biases, const float *x,
                        const float *xs, float *out, Py_ssize_t m, Py_ssize_t k, Py_ssize_t n, Py_ssize_t group);
AVX512 void row8_avx512(const uint8_t *codes, const float *scales, const float *biases, const float *x,
                        const float *xs, float *out, Py_ssize_t m, Py_ssize_t k, Py_ssize_t n, Py_ssize_t group);
AVX512 void tile_512(int bits, Py_ssize_t group, int wr, const uint8_t *codes, const float *s, const float *bi,
                     const float *x, const float *xs, float *out, Py_ssize_t n, Py_ssize_t k, Py_ssize_t left);
AVX512 void halves_512(const uint16_t *h, float *f, Py_ssize_t n);

/* x86/blocks_x86.c */
AVX2 void decode_row_avx2(int type, const uint8_t *raw, Py_ssize_t blocks, Py_ssize_t block_bytes,
                          Py_ssize_t code_bytes, Py_ssize_t per, uint8_t *codes, float *s, float *bi);
AVX512 void blocks_rows_512(int type, const uint8_t *raw, Py_ssize_t raw_row, Py_ssize_t r0, Py_ssize_t r1,
                            Py_ssize_t left, const float *x, const float *xs, float *y, Py_ssize_t m, Py_ssize_t k,
                            Py_ssize_t n, Py_ssize_t groups);
AVX2 void blocks_rows_avx2(int type, const uint8_t *raw, Py_ssize_t raw_row, Py_ssize_t r0, Py_ssize_t r1,
                           Py_ssize_t left, const float *x, const float *xs, float *y, Py_ssize_t m, Py_ssize_t k,
                           Py_ssize_t n, Py_ssize_t groups);

/* x86/q8_x86.c */
AVX2 void q8_pack_spans_avx2(int bits, const uint8_t *cr, Py_ssize_t spans, Py_ssize_t group, uint8_t *out);
AVX512VNNI void q8_tile_vnni(const uint8_t *wq, const float *ws, const float *wb, Py_ssize_t rows,
                             const struct q8x *X, Py_ssize_t m, float *y, Py_ssize_t n);
AVX2 void q8_tile_avx2(const uint8_t *wq, const float *ws, const float *wb, Py_ssize_t rows, const struct q8x *X,
                       Py_ssize_t m, float *y, Py_ssize_t n, int code_max);
/* x86/q8row_x86.c: X's row 0 (in column order) against rows [r0, r1) of block-form W into y[r] (m unused;
 * q8_few_rows_vnni: X's m rows in turn, into y[i * n + r]; q8_rows_affine_avx2: row 0 against an affine W) */
AVX512VNNI void q8_rows_vnni(int type, const uint8_t *raw, Py_ssize_t raw_row, Py_ssize_t r0, Py_ssize_t r1,
                             Py_ssize_t left, const struct q8x *X, Py_ssize_t m, float *y, Py_ssize_t k, Py_ssize_t n);
AVX512VNNI void q8_few_rows_vnni(int type, const uint8_t *raw, Py_ssize_t raw_row, Py_ssize_t r0, Py_ssize_t r1,
                                 Py_ssize_t left, const struct q8x *X, Py_ssize_t m, float *y, Py_ssize_t k,
                                 Py_ssize_t n);
AVX2 void q8_rows_avx2(int type, const uint8_t *raw, Py_ssize_t raw_row, Py_ssize_t r0, Py_ssize_t r1,
                       Py_ssize_t left, const struct q8x *X, Py_ssize_t m, float *y, Py_ssize_t k, Py_ssize_t n);
/* the same against X's m rows (2..Q8_FEW) at once, into y[i * n + r] */
AVX2 void q8_few_rows_avx2(int type, const uint8_t *raw, Py_ssize_t raw_row, Py_ssize_t r0, Py_ssize_t r1,
                           Py_ssize_t left, const struct q8x *X, Py_ssize_t m, float *y, Py_ssize_t k, Py_ssize_t n);
AVX2 void q8_rows_affine_avx2(int bits, Py_ssize_t group, const uint8_t *codes, const void *scales, const void *biases,
                              float factor, int half, Py_ssize_t r0, Py_ssize_t r1, Py_ssize_t left, const struct q8x *X,
                              float *y, Py_ssize_t k);
AVX512 void q8_quantize_natural_512(const float *x, Py_ssize_t k, Py_ssize_t group, int8_t *q, float *dx, float *xs,
                                    int32_t *qs);
AVX2 void q8_quantize_natural_avx2(const float *x, Py_ssize_t k, Py_ssize_t group, int8_t *q, float *dx, float *xs,
                                   int32_t *qs);
AVX512VNNI double peak_vnni512(long iterations);
AVX2 double peak_maddubs256(long iterations);
AVX512 double peak_fma512(long iterations);
AVX2 double peak_fma256(long iterations);

/* x86/kvq8_x86.c */
AVX2 void q8_0_scores_avx2(const uint8_t *const *keys, Py_ssize_t n, const int8_t *q, const float *qd,
                           Py_ssize_t heads, Py_ssize_t blocks, float *s, Py_ssize_t stride);
AVX512VNNI void q8_0_scores_vnni(const uint8_t *const *keys, Py_ssize_t n, const int8_t *q, const float *qd,
                                 Py_ssize_t heads, Py_ssize_t blocks, float *s, Py_ssize_t stride);
#endif

/* -- exact products of many rows (tiled.c) ------------------------------------------- */

#ifndef TILED_KC
#define TILED_KC 128      /* columns of W transposed into a tile at a time: the tile (16 KiB at nr 32) and x's block stay in L1 */
#endif
#define TILED_NR_512 32   /* weight rows a panel on AVX-512 (two zmm of a tile row) */
#define TILED_MR_512 12   /* activation rows a micro-kernel call on AVX-512: 24 zmm of sums */
#define TILED_NR_AVX2 16  /* and on AVX2 (two ymm) */
#define TILED_MR_AVX2 6   /* 12 ymm of sums */
int tiled_run(int bits, const float *x, const uint8_t *c, const void *scales, const void *biases, float factor,
              int half, float *y, Py_ssize_t m, Py_ssize_t k, Py_ssize_t n, Py_ssize_t group);
#ifdef HAVE_X86
/* x86/tiled_x86.c */
AVX2 void transpose_avx2(const float *rows, Py_ssize_t k, Py_ssize_t c0, Py_ssize_t kc, Py_ssize_t nr, float *tile);
AVX512 void micro_512(const float *tile, Py_ssize_t kc, const float *x, float *y, Py_ssize_t ldy,
                      Py_ssize_t rows, Py_ssize_t valid, int first);
AVX2 void micro_avx2(const float *tile, Py_ssize_t kc, const float *x, float *y, Py_ssize_t ldy,
                     Py_ssize_t rows, Py_ssize_t valid, int first);
#endif

#endif
