/* The numpy backend's captured decode step: a program of kernel calls, run in
 * one call from Python.
 *
 * The program calls the very functions the per-op Python entry points call
 * (gemv_run, gemvf_run, rms_rows, rope_rows, attention_run, dequant_rows:
 * kernels.h), so a step run here computes what the same op computes eagerly.
 *
 * backends/cpu/plan.py records the program while the step runs once through
 * the backend's ops (the trace); the program is then a flat list of int64:
 * per step an opcode and its operands, pointers as two values (base, offset):
 * base -1 is an absolute address (a weight, a constant, a buffer the plan owns
 * and keeps alive), base i >= 0 is byte offset into the i-th input of the call
 * (the token ids, the position, the KV cache buffers), resolved anew at every
 * call. Float operands come from a separate list of float64. What depends on
 * the data (the token id, the position) is read from the inputs inside the
 * step, so one program serves every position: positions, lengths and ids are
 * bounds-checked here, at run time, and a bad one stops the program with an
 * error rather than touching memory outside its buffers.
 */

#include "kernels.h"

enum {
    OP_GEMV = 1,     /* P x, codes, scales, biases|0, out; I bits, m, k, n, group, half; F bias factor */
    OP_GEMV_F32,     /* P x, w, out; I m, k, n */
    OP_RMS,          /* P x, w|0, out, res|0, h|0; I rows, n; F eps */
    OP_ROPE,         /* P x, cos, sin, out; I tokens, heads, d, half */
    OP_GATHER,       /* P table, ids, out; I count, vocab, row_bytes, id_bytes, rows (0: token ids, 1: row indices) */
    OP_DEQUANT_ROWS, /* P codes, scales, biases|0, ids, out; I count, vocab, bits, k, group, half, id_bytes;
                        F bias factor */
    OP_COPY,         /* P x, out; I item_bytes, ndim, shape[ndim], x strides[ndim] (bytes); out contiguous */
    OP_UNARY,        /* P x, out; I kind, ndim, shape[ndim], x strides[ndim]; float32 out contiguous */
    OP_BINARY,       /* P a, b, out; I kind, int32?, ndim, shape[ndim], a strides[ndim], b strides[ndim] */
    OP_REDUCE,       /* P x, out; I kind, rows, n: over the last axis of a contiguous float32 [rows, n] */
    OP_LAYERNORM,    /* P x, w|0, b|0, out; I rows, n; F eps */
    OP_SCATTER_ROWS, /* P dst, rows (int32 [n]), src; I n, row_bytes (dst's), capacity, to_half (float32 src
                        rows rounded into a float16 dst: a kv_dtype="float16" pool; 2: quantized into
                        q8_0 blocks, a kv_dtype="q8_0" pool) */
    OP_ATTENTION,    /* P q, k rows, v rows, out, query_start (int32 [batch + 1]), lengths (int32 [batch]),
                        tables (int32 [batch, width]), sinks|0 (float32 [hq]);
                        I tokens, batch, width, block, blocks, hq, hkv, dk, dv, window, causal, half (k and v
                        rows float16; KV_Q8_0: q8_0 blocks); F scale, softcap */
    /* The recurrent layers' ops (recurrent.c), their batch read from the step's inputs: query_start
     * (int32 [nseq + 1]) and checkpoint rows (int32 [nrows]) checked against the T rows at every run. */
    OP_CONV1D,       /* P x, window, weight transposed [K, C], bias|0, query_start, rows|0, y, last, ckpt;
                        I nseq, nrows, T, C, K, silu */
    OP_GDR,          /* P q, k, v, g, beta, state, query_start, rows|0, o, last, ckpt, slots|0;
                        I nseq, nrows, T, Hk, H, K, V, l2norm, chunked, capacity; F scale */
    OP_SSD,          /* P x, dt, A, B, C, D|0, dt_bias|0, state, query_start, rows|0, y, last, ckpt, slots|0;
                        I nseq, nrows, T, H, P, G, N, softplus, capacity; F dt_min, dt_max */
    /* With slots (int32 [nseq], each below capacity), state and last are one pool of capacity rows,
     * sequence b's state its row slots[b], updated in place (record.py: a gather and a scatter saved). */
    /* Mixture-of-experts routing and products (architectures/moe.py), the expert ids data of the step. */
    OP_TOPK,         /* P x (float32 [rows, n]), values (float32 [rows, k]), ids (int32 [rows, k]); I rows, n, k:
                        each row's k largest, largest first, the lower index first among equal values, NaN
                        last (the numpy backend's stable argsort of -x) */
    OP_EXPERT_GEMV,  /* P x (float32 [m, k]), ids (int32 [m]), table (int64 [experts, 3]: the codes, scales and
                        biases|0 addresses of each expert's weight; float32 weights: [experts, 1]), out [m, n];
                        I experts, bits (-1: float32 weights), m, k, n, group, half; F bias factor: row i times
                        expert ids[i]'s weight, each expert's rows gathered in order and multiplied together,
                        as the contract's expert_linear groups them */
    /* LoRA adapters' rows (infer/adapters): the base product y plus each row's low-rank term, its adapter
     * slot and scale read from the step's inputs, so one program serves every mix of adapters. */
    OP_LORA,         /* P x [T, in], y [T, out], a [S, R, in], b [S, out, R], slots (int32 [T]), scales (float32
                        [T]), out [T, out], scratch xs [T, in], u [T, R], d [T, out]; I T, in, out, R, S */
};

/* The opcodes by name, for the recorder (backends/cpu/record.py reads them
 * through _kernels.opcodes(), so the two never disagree). */
static const struct { const char *name; int code; } OPCODES[] = {
    {"GEMV", OP_GEMV}, {"GEMV_F32", OP_GEMV_F32}, {"RMS", OP_RMS}, {"ROPE", OP_ROPE}, {"GATHER", OP_GATHER},
    {"DEQUANT_ROWS", OP_DEQUANT_ROWS}, {"COPY", OP_COPY}, {"UNARY", OP_UNARY}, {"BINARY", OP_BINARY},
    {"REDUCE", OP_REDUCE}, {"LAYERNORM", OP_LAYERNORM}, {"SCATTER_ROWS", OP_SCATTER_ROWS},
    {"ATTENTION", OP_ATTENTION}, {"CONV1D", OP_CONV1D}, {"GDR", OP_GDR}, {"SSD", OP_SSD},
    {"TOPK", OP_TOPK}, {"EXPERT_GEMV", OP_EXPERT_GEMV},
    {"LORA", OP_LORA},
};

enum { U_CAST_I32, U_NEG, U_EXP, U_SQRT, U_TANH, U_COS, U_SIN, U_SILU, U_GELU_TANH, U_GELU_ERF, U_SOFTPLUS };
enum { B_ADD, B_SUB, B_MUL, B_DIV };
enum { R_MAX, R_ARGMAX, R_SUM };
enum { E_OK, E_PROGRAM, E_MEMORY, E_TOKEN, E_ROW, E_EXPERT, E_POSITION, E_LENGTH, E_ROWS, E_SLOT, E_BLOCK, E_BATCH,
       E_ADAPTER, E_STATE };

#define MAX_DIMS 8

struct machine {
    const int64_t *code;
    Py_ssize_t pc, size;
    const double *floats;
    Py_ssize_t fc, nfloats;
    char *const *inputs;
    Py_ssize_t ninputs;
    int error;
    long long detail, limit; /* what was out of range, and the range */
};

static int64_t next_int(struct machine *vm) {
    if (vm->pc >= vm->size) {
        vm->error = E_PROGRAM;
        return 0;
    }
    return vm->code[vm->pc++];
}

static double next_float(struct machine *vm) {
    if (vm->fc >= vm->nfloats) {
        vm->error = E_PROGRAM;
        return 0.0;
    }
    return vm->floats[vm->fc++];
}

static void *next_ptr(struct machine *vm) {
    int64_t base = next_int(vm), offset = next_int(vm);
    if (base < 0) return (void *)(intptr_t)offset;
    if (base >= vm->ninputs) {
        vm->error = E_PROGRAM;
        return NULL;
    }
    return vm->inputs[base] + offset;
}

static float unary1(int kind, float x) {
    switch (kind) {
    case U_NEG: return -x;
    case U_EXP: return expf(x);
    case U_SQRT: return sqrtf(x);
    case U_TANH: return tanhf(x);
    case U_COS: return cosf(x);
    case U_SIN: return sinf(x);
    case U_GELU_ERF: /* erf in float64 of the float32 x / sqrt(2), as the numpy backend; the last product too */
        return (float)((double)(0.5f * x) * (1.0 + erf((double)(x / (float)1.4142135623730951))));
    case U_SOFTPLUS: /* numpy's logaddexp(0, x): the larger, plus log1p of exp of minus the gap */
        return (x > 0.0f ? x : 0.0f) + log1pf(expf(-fabsf(x)));
    default: return x;
    }
}

/* An elementwise step's iteration space: its shape, each operand's byte
 * strides, and the rows of its last dimension the loops walk. */
struct strided {
    int ndim;
    Py_ssize_t shape[MAX_DIMS], strides[2][MAX_DIMS];
    Py_ssize_t n, inner, step[2]; /* elements; a row's length, and each operand's stride along it */
};

/* The next words: ndim, the shape, then count operands' strides; 0 on a malformed program. */
static int next_strided(struct machine *vm, int count, struct strided *s) {
    int64_t ndim = next_int(vm);
    if (ndim < 0 || ndim > MAX_DIMS) vm->error = E_PROGRAM;
    if (vm->error) return 0;
    s->ndim = (int)ndim;
    for (int d = 0; d < s->ndim; d++) s->shape[d] = next_int(vm);
    for (int a = 0; a < count; a++)
        for (int d = 0; d < s->ndim; d++) s->strides[a][d] = next_int(vm);
    if (vm->error) return 0;
    s->n = 1;
    for (int d = 0; d < s->ndim; d++) s->n *= s->shape[d];
    s->inner = s->ndim ? s->shape[s->ndim - 1] : 1;
    for (int a = 0; a < count; a++) s->step[a] = s->ndim ? s->strides[a][s->ndim - 1] : 0;
    return 1;
}

/* The byte offset into each of count operands of the element after `flat`. */
static void offsets(const struct strided *s, Py_ssize_t flat, int count, Py_ssize_t *off) {
    for (int a = 0; a < count; a++) off[a] = 0;
    for (int d = s->ndim - 1; d >= 0; d--) {
        Py_ssize_t i = flat % s->shape[d];
        flat /= s->shape[d];
        for (int a = 0; a < count; a++) off[a] += i * s->strides[a][d];
    }
}

static void step_copy(struct machine *vm) {
    const char *x = next_ptr(vm);
    char *out = next_ptr(vm);
    int64_t item = next_int(vm);
    struct strided s;
    Py_ssize_t off[1];
    if (!next_strided(vm, 1, &s)) return;
    for (Py_ssize_t i = 0; i < s.n; i += s.inner) {
        offsets(&s, i, 1, off);
        if (s.step[0] == item) {
            memcpy(out + i * item, x + off[0], (size_t)(s.inner * item));
        } else {
            for (Py_ssize_t j = 0; j < s.inner; j++)
                memcpy(out + (i + j) * item, x + off[0] + j * s.step[0], (size_t)item);
        }
    }
}

/* Elements from which a transcendental step (exp, tanh, the GELUs, ...) is
 * split over the kernels' threads: libm's tanhf takes about 19 ns a value
 * here, so Gemma 3's GELU over 2,048 values a layer ran about 40 us on one
 * core while the other's OpenMP worker spun (5.5% of its q8 decode samples). */
#define UNARY_PARALLEL 1024

/* Elements [f0, f1) of a unary step, in its rows' order. */
static void unary_span(int kind, const char *x, float *out, const struct strided *s, Py_ssize_t f0, Py_ssize_t f1) {
    Py_ssize_t off[1];
    for (Py_ssize_t f = f0; f < f1;) {
        const Py_ssize_t i = f - f % s->inner, j1 = s->inner < f1 - i ? s->inner : f1 - i; /* its row, the row's end here */
        offsets(s, i, 1, off);
        const char *row = x + off[0];
        if (kind == U_CAST_I32) {
            for (Py_ssize_t j = f - i; j < j1; j++) out[i + j] = (float)*(const int32_t *)(row + j * s->step[0]);
        } else if (kind == U_SILU || kind == U_GELU_TANH) { /* unary.c's, as the eager op: the values gathered where the row is strided */
            for (Py_ssize_t j = f - i; j < j1;) {
                const Py_ssize_t c = s->step[0] == 4 ? j1 - j : (j1 - j < 64 ? j1 - j : 64);
                float buf[64];
                const float *src = (const float *)(row + j * s->step[0]);
                if (s->step[0] != 4)
                    for (Py_ssize_t t = 0; t < c; t++) buf[t] = *(const float *)(row + (j + t) * s->step[0]);
                act_rows(kind == U_SILU ? ACT_SILU : ACT_GELU_TANH, s->step[0] == 4 ? src : buf, c, NULL, 0,
                         out + i + j, 1, c, 0);
                j += c;
            }
        } else {
            for (Py_ssize_t j = f - i; j < j1; j++) out[i + j] = unary1(kind, *(const float *)(row + j * s->step[0]));
        }
        f = i + j1;
    }
}

static void step_unary(struct machine *vm) {
    const char *x = next_ptr(vm);
    float *out = next_ptr(vm);
    int kind = (int)next_int(vm);
    struct strided s;
    if (!next_strided(vm, 1, &s)) return;
    const int heavy = kind != U_CAST_I32 && kind != U_NEG && kind != U_SQRT &&
                      ((kind != U_SILU && kind != U_GELU_TANH) || s.n >= SILU_PARALLEL); /* in vectors: unary.c */
    if (!heavy || s.n < UNARY_PARALLEL || max_threads() < 2) {
        unary_span(kind, x, out, &s, 0, s.n);
        return;
    }
#ifdef _OPENMP
    /* each element is its own: any split gives the same bits */
    #pragma omp parallel
    {
        const Py_ssize_t t = omp_get_thread_num(), T = omp_get_num_threads();
        unary_span(kind, x, out, &s, s.n * t / T, s.n * (t + 1) / T);
    }
#endif
}

static void step_binary(struct machine *vm) {
    const char *a = next_ptr(vm), *b = next_ptr(vm);
    char *out = next_ptr(vm);
    int kind = (int)next_int(vm), ints = (int)next_int(vm);
    struct strided s;
    Py_ssize_t off[2];
    if (!next_strided(vm, 2, &s)) return;
    if (kind < B_ADD || kind > B_DIV || (ints && kind == B_DIV)) {
        vm->error = E_PROGRAM;
        return;
    }
    const Py_ssize_t sa = s.step[0], sb = s.step[1];
    for (Py_ssize_t i = 0; i < s.n; i += s.inner) {
        offsets(&s, i, 2, off);
        const char *ra = a + off[0], *rb = b + off[1];
        if (ints) { /* int32, wrapping as numpy's does */
            int32_t *o = (int32_t *)out + i;
            for (Py_ssize_t j = 0; j < s.inner; j++) {
                uint32_t u = (uint32_t)*(const int32_t *)(ra + j * sa), v = (uint32_t)*(const int32_t *)(rb + j * sb);
                o[j] = (int32_t)(kind == B_ADD ? u + v : kind == B_SUB ? u - v : u * v);
            }
            continue;
        }
        float *o = (float *)out + i;
        for (Py_ssize_t j = 0; j < s.inner; j++) {
            float u = *(const float *)(ra + j * sa), v = *(const float *)(rb + j * sb);
            o[j] = kind == B_ADD ? u + v : kind == B_SUB ? u - v : kind == B_MUL ? u * v : u / v;
        }
    }
}

/* numpy's max and argmax over the last axis: a NaN wins (the first one, for argmax). */
/* numpy's float32 sum of n contiguous values (its pairwise summation: eight running sums over
 * blocks of up to 128, halves beyond), in the same order, so a program's sum is numpy's to the bit. */
static float pairwise_sum(const float *a, Py_ssize_t n) {
    if (n < 8) {
        float res = -0.0f;
        for (Py_ssize_t i = 0; i < n; i++) res += a[i];
        return res;
    }
    if (n <= 128) {
        float r[8];
        Py_ssize_t i;
        for (int j = 0; j < 8; j++) r[j] = a[j];
        for (i = 8; i < n - (n % 8); i += 8)
            for (int j = 0; j < 8; j++) r[j] += a[i + j];
        float res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for (; i < n; i++) res += a[i];
        return res;
    }
    Py_ssize_t half = n / 2;
    half -= half % 8;
    return pairwise_sum(a, half) + pairwise_sum(a + half, n - half);
}

static void step_reduce(struct machine *vm) {
    const float *x = next_ptr(vm);
    char *out = next_ptr(vm);
    int kind = (int)next_int(vm);
    Py_ssize_t rows = next_int(vm), n = next_int(vm);
    if (vm->error || n < 1) {
        vm->error = E_PROGRAM;
        return;
    }
    for (Py_ssize_t r = 0; r < rows; r++) {
        const float *row = x + r * n;
        if (kind == R_SUM) {
            ((float *)out)[r] = pairwise_sum(row, n);
            continue;
        }
        Py_ssize_t best = 0;
        float top = row[0];
        for (Py_ssize_t j = 1; j < n && top == top; j++)
            if (row[j] > top || row[j] != row[j]) {
                top = row[j];
                best = j;
            }
        if (kind == R_MAX)
            ((float *)out)[r] = top;
        else
            ((int64_t *)out)[r] = best;
    }
}

/* ids[i] as a row index of a table of vocab rows, or -1 (and the error set: `error`, E_TOKEN
 * for an embedding's token ids, E_ROW for other gathers' row indices). */
static Py_ssize_t row_id(struct machine *vm, const char *ids, Py_ssize_t i, int64_t id_bytes, Py_ssize_t vocab,
                         int error) {
    long long id = id_bytes == 8 ? ((const int64_t *)ids)[i] : ((const int32_t *)ids)[i];
    if (id < 0 || id >= vocab) {
        vm->error = error;
        vm->detail = id;
        vm->limit = vocab;
        return -1;
    }
    return (Py_ssize_t)id;
}

static int32_t position(struct machine *vm, const int32_t *at, Py_ssize_t count, Py_ssize_t capacity, int error) {
    int32_t p = *at;
    if (p < 0 || (Py_ssize_t)p + count > capacity) {
        vm->error = error;
        vm->detail = (long long)p + count;
        vm->limit = capacity;
    }
    return p;
}

/* Scratch of at least `need` floats in *buf (grown, never shrunk); 0 when out of memory. */
/* Whether each of tq query rows sees a key among tk: the eager path's own condition. */
static int sees_keys(struct machine *vm, Py_ssize_t tk, Py_ssize_t tq) {
    if (tk >= tq) return 1;
    vm->error = E_ROWS;
    vm->detail = tk;
    vm->limit = tq;
    return 0;
}

/* Causal attention of each sequence's tq query rows over its own keys, read in
 * place from the paged pools through its row of the block tables: per
 * sequence, what the eager op's C pass computes with that sequence's table. */
/* Attention of a batch of sequences over pool rows: sequence b's query rows
 * query_start[b]..query_start[b+1] are the last of its lengths[b] positions,
 * whose keys its block table row locates (see Backend.attention). */
static void step_attention(struct machine *vm) {
    struct attend_args a;
    const float *Q = next_ptr(vm);
    a.K = next_ptr(vm);
    a.V = next_ptr(vm);
    float *O = next_ptr(vm);
    const int32_t *starts = next_ptr(vm), *lengths = next_ptr(vm), *tables = next_ptr(vm);
    a.sinks = next_ptr(vm);
    Py_ssize_t tokens = next_int(vm), batch = next_int(vm);
    Py_ssize_t width = next_int(vm), block = next_int(vm), blocks = next_int(vm);
    a.hq = next_int(vm);
    a.hkv = next_int(vm);
    a.dk = next_int(vm);
    a.dv = next_int(vm);
    a.window = next_int(vm);
    a.causal = (int)next_int(vm);
    a.half = (int)next_int(vm);
    a.scale = (float)next_float(vm);
    a.softcap = (float)next_float(vm);
    if (vm->error) return;
    if (batch < 1 || width < 1 || block < 1) {
        vm->error = E_PROGRAM;
        return;
    }
    Py_ssize_t most = width * block;
    Py_ssize_t *rows = malloc((size_t)most * sizeof(Py_ssize_t));
    if (!rows) {
        vm->error = E_MEMORY;
        return;
    }
    a.rows = rows;
    for (Py_ssize_t b = 0; b < batch && !vm->error; b++) {
        Py_ssize_t q0 = position(vm, starts + b, 0, tokens, E_LENGTH);
        Py_ssize_t q1 = position(vm, starts + b + 1, 0, tokens, E_LENGTH);
        if (vm->error) break;
        if (q1 < q0) {
            vm->error = E_LENGTH;
            vm->detail = q1;
            vm->limit = q0;
            break;
        }
        a.tq = q1 - q0;
        if (a.tq == 0) continue; /* a padding sequence with no rows */
        a.tk = position(vm, lengths + b, 0, most, E_LENGTH);
        if (vm->error || !sees_keys(vm, a.tk, a.tq)) break;
        const int32_t *table = tables + b * width;
        for (Py_ssize_t j = 0; j < a.tk; j++) {
            int32_t t = table[j / block];
            if (t < 0 || t >= blocks) {
                vm->error = E_BLOCK;
                vm->detail = t;
                vm->limit = blocks;
                break;
            }
            rows[j] = (Py_ssize_t)t * block + j % block;
        }
        if (vm->error) break;
        a.Q = Q + q0 * a.hq * a.dk;
        a.O = O + q0 * a.hq * a.dv;
        if (a.half == KV_Q8_0 && (a.dk % 32 || a.dv % 32))
            vm->error = E_PROGRAM;
        else if (!attention_run(&a, 1))
            vm->error = E_MEMORY;
    }
    free(rows);
}

/* A recurrent step's batch (query_start and checkpoint rows from the inputs) checked against its
 * rows, and the checkpoints' order into a new array (the caller frees it); NULL with vm->error set. */
static int64_t *step_batch(struct machine *vm, const int32_t *qs, Py_ssize_t nseq, Py_ssize_t T,
                           const int32_t *rows, Py_ssize_t nrows) {
    if (vm->error) return NULL;
    if (nseq < 1 || nrows < 0 || (nrows && !rows)) {
        vm->error = E_PROGRAM;
        return NULL;
    }
    int64_t *order = malloc((size_t)(nrows + 1) * sizeof(int64_t));
    if (!order) {
        vm->error = E_MEMORY;
        return NULL;
    }
    if (!recurrent_batch(qs, nseq, T, rows, nrows, order)) {
        free(order);
        vm->error = E_BATCH;
        vm->limit = T;
        return NULL;
    }
    return order;
}

static void step_conv1d(struct machine *vm) {
    struct conv_args a;
    a.x = next_ptr(vm);
    a.window = next_ptr(vm);
    a.wt = next_ptr(vm);
    a.bias = next_ptr(vm);
    a.qs = next_ptr(vm);
    a.rows = next_ptr(vm);
    a.y = next_ptr(vm);
    a.last = next_ptr(vm);
    a.ckpt = next_ptr(vm);
    a.nseq = next_int(vm);
    a.nrows = next_int(vm);
    Py_ssize_t T = next_int(vm);
    a.C = next_int(vm);
    a.K = next_int(vm);
    a.silu = (int)next_int(vm);
    a.parallel = 1; /* a program's products are the kernels' own threads, not BLAS's */
    int64_t *order = step_batch(vm, a.qs, a.nseq, T, a.rows, a.nrows);
    if (!order) return;
    a.order = order;
    conv1d_run(&a);
    free(order);
}

/* A recurrent step's slots (NULL: none) each within the pool's capacity rows. */
static int slots_ok(struct machine *vm, const int32_t *slots, Py_ssize_t nseq, Py_ssize_t capacity) {
    if (vm->error) return 0;
    for (Py_ssize_t b = 0; slots && b < nseq; b++)
        if (slots[b] < 0 || slots[b] >= capacity) {
            vm->error = E_STATE;
            vm->detail = slots[b];
            vm->limit = capacity;
            return 0;
        }
    return 1;
}

static void step_gdr(struct machine *vm) {
    struct gdr_args a;
    const float *q = next_ptr(vm), *k = next_ptr(vm);
    a.v = next_ptr(vm);
    a.g = next_ptr(vm);
    a.beta = next_ptr(vm);
    a.state = next_ptr(vm);
    a.qs = next_ptr(vm);
    a.rows = next_ptr(vm);
    a.o = next_ptr(vm);
    a.last = next_ptr(vm);
    a.ckpt = next_ptr(vm);
    a.slots = next_ptr(vm);
    a.nseq = next_int(vm);
    a.nrows = next_int(vm);
    Py_ssize_t T = next_int(vm);
    a.Hk = next_int(vm);
    a.H = next_int(vm);
    a.K = next_int(vm);
    a.V = next_int(vm);
    int l2norm = (int)next_int(vm);
    a.chunked = (int)next_int(vm);
    Py_ssize_t capacity = next_int(vm);
    a.parallel = 1;
    float scale = (float)next_float(vm);
    if (!vm->error && (a.Hk < 1 || a.H % a.Hk || a.K < 1 || a.K > GDR_MAX_K)) vm->error = E_PROGRAM;
    if (!slots_ok(vm, a.slots, a.nseq, capacity)) return;
    int64_t *order = step_batch(vm, a.qs, a.nseq, T, a.rows, a.nrows);
    if (!order) return;
    float *qn = malloc((size_t)(2 * T * a.Hk * a.K + 1) * sizeof(float));
    if (!qn) {
        free(order);
        vm->error = E_MEMORY;
        return;
    }
    gdr_prepare(q, k, qn, qn + T * a.Hk * a.K, T * a.Hk, a.K, scale, l2norm);
    a.q = qn;
    a.k = qn + T * a.Hk * a.K;
    a.order = order;
    if (gdr_run(&a)) vm->error = E_MEMORY;
    free(qn);
    free(order);
}

static void step_ssd(struct machine *vm) {
    struct ssd_args a;
    a.x = next_ptr(vm);
    const float *dt = next_ptr(vm);
    a.A = next_ptr(vm);
    a.B = next_ptr(vm);
    a.C = next_ptr(vm);
    a.D = next_ptr(vm);
    const float *bias = next_ptr(vm);
    a.state = next_ptr(vm);
    a.qs = next_ptr(vm);
    a.rows = next_ptr(vm);
    a.y = next_ptr(vm);
    a.last = next_ptr(vm);
    a.ckpt = next_ptr(vm);
    a.slots = next_ptr(vm);
    a.nseq = next_int(vm);
    a.nrows = next_int(vm);
    Py_ssize_t T = next_int(vm);
    a.H = next_int(vm);
    a.P = next_int(vm);
    a.G = next_int(vm);
    a.N = next_int(vm);
    int softplus = (int)next_int(vm);
    Py_ssize_t capacity = next_int(vm);
    a.parallel = 1;
    float lo = (float)next_float(vm), hi = (float)next_float(vm);
    if (!vm->error && (a.G < 1 || a.H % a.G || a.N < 1 || a.N > SSD_MAX_N)) vm->error = E_PROGRAM;
    if (!slots_ok(vm, a.slots, a.nseq, capacity)) return;
    int64_t *order = step_batch(vm, a.qs, a.nseq, T, a.rows, a.nrows);
    if (!order) return;
    float *step = malloc((size_t)(T * a.H + 1) * sizeof(float));
    if (!step) {
        free(order);
        vm->error = E_MEMORY;
        return;
    }
    ssd_steps(dt, bias, step, T, a.H, softplus, lo, hi);
    a.step = step;
    a.order = order;
    ssd_run(&a);
    free(step);
    free(order);
}

/* Whether a ranks before b in a descending sort with NaN last. */
static int ranks_before(float a, float b) { return a == a && (b != b || a > b); }

static void step_topk(struct machine *vm) {
    const float *x = next_ptr(vm);
    float *values = next_ptr(vm);
    int32_t *ids = next_ptr(vm);
    Py_ssize_t rows = next_int(vm), n = next_int(vm), k = next_int(vm);
    if (!vm->error && (n < 1 || k < 1 || k > n)) vm->error = E_PROGRAM;
    if (vm->error) return;
    char *taken = malloc((size_t)n);
    if (!taken) {
        vm->error = E_MEMORY;
        return;
    }
    for (Py_ssize_t r = 0; r < rows; r++) {
        const float *row = x + r * n;
        memset(taken, 0, (size_t)n);
        for (Py_ssize_t j = 0; j < k; j++) { /* k is a few experts: selection, not a sort */
            Py_ssize_t best = -1;
            for (Py_ssize_t i = 0; i < n; i++)
                if (!taken[i] && (best < 0 || ranks_before(row[i], row[best]))) best = i;
            taken[best] = 1;
            values[r * k + j] = row[best];
            ids[r * k + j] = (int32_t)best;
        }
    }
    free(taken);
}

/* OP_LORA: out = y, then for each adapter slot its rows (scale not 0) gathered, u = x @ a[slot].T,
 * u *= each row's scale, out += u @ b[slot].T: the numpy backend's lora_linear step by step, on the same
 * float32 product (gemvf_run, whose row sums do not depend on how many rows it is given), so a captured
 * step's adapter rows are the eager ones bit for bit. Slots are checked before anything is written. */
static void step_lora(struct machine *vm) {
    const float *x = next_ptr(vm), *y = next_ptr(vm), *a = next_ptr(vm), *b = next_ptr(vm);
    const int32_t *slots = next_ptr(vm);
    const float *scales = next_ptr(vm);
    float *out = next_ptr(vm), *xs = next_ptr(vm), *u = next_ptr(vm), *d = next_ptr(vm);
    Py_ssize_t T = next_int(vm), in = next_int(vm), n_out = next_int(vm), R = next_int(vm), S = next_int(vm);
    if (vm->error) return;
    if (T < 1 || in < 1 || n_out < 1 || R < 1 || S < 1) {
        vm->error = E_PROGRAM;
        return;
    }
    for (Py_ssize_t t = 0; t < T; t++)
        if (scales[t] != 0.0f && (slots[t] < 0 || slots[t] >= S)) {
            vm->error = E_ADAPTER;
            vm->detail = slots[t];
            vm->limit = S;
            return;
        }
    memcpy(out, y, (size_t)(T * n_out) * sizeof(float));
    for (Py_ssize_t t = 0; t < T; t++) {
        if (scales[t] == 0.0f) continue;
        int32_t slot = slots[t];
        int seen = 0; /* each slot once, at its first active row */
        for (Py_ssize_t e = 0; e < t && !seen; e++) seen = scales[e] != 0.0f && slots[e] == slot;
        if (seen) continue;
        Py_ssize_t rows = 0;
        for (Py_ssize_t r = t; r < T; r++)
            if (scales[r] != 0.0f && slots[r] == slot) memcpy(xs + rows++ * in, x + r * in, (size_t)in * sizeof(float));
        gemvf_run(xs, a + (Py_ssize_t)slot * R * in, u, rows, in, R);
        for (Py_ssize_t r = t, i = 0; r < T; r++)
            if (scales[r] != 0.0f && slots[r] == slot) {
                for (Py_ssize_t c = 0; c < R; c++) u[i * R + c] *= scales[r];
                i++;
            }
        gemvf_run(u, b + (Py_ssize_t)slot * n_out * R, d, rows, R, n_out);
        for (Py_ssize_t r = t, i = 0; r < T; r++)
            if (scales[r] != 0.0f && slots[r] == slot) {
                for (Py_ssize_t c = 0; c < n_out; c++) out[r * n_out + c] += d[i * n_out + c];
                i++;
            }
    }
}

/* The shape of a product's codes as gemv checks it (a malformed program stops here). GEMV's and
 * DEQUANT_ROWS's bits may be a block form (kernels.h, FORM_BLOCKS): codes are then the file's blocks. */
static int codes_ok(struct machine *vm, int bits, Py_ssize_t group, Py_ssize_t k, int half, const void *biases) {
    if (vm->error || !shape_ok(bits, group, half, k, biases != NULL)) {
        vm->error = vm->error ? vm->error : E_PROGRAM;
        return 0;
    }
    return 1;
}

static void step_expert_gemv(struct machine *vm) {
    const float *x = next_ptr(vm);
    const int32_t *ids = next_ptr(vm);
    const int64_t *table = next_ptr(vm);
    float *out = next_ptr(vm);
    Py_ssize_t experts = next_int(vm);
    int bits = (int)next_int(vm);
    Py_ssize_t m = next_int(vm), k = next_int(vm), n = next_int(vm), group = next_int(vm);
    int half = (int)next_int(vm);
    float factor = (float)next_float(vm);
    if (!vm->error && (experts < 1 || m < 1 || k < 1 || n < 1)) vm->error = E_PROGRAM;
    if (vm->error || (bits >= 0 && !codes_ok(vm, bits & ~Q8_FLAG, group, k, half, (const void *)(intptr_t)table[2])))
        return;
    for (Py_ssize_t i = 0; i < m; i++)
        if (ids[i] < 0 || ids[i] >= experts) {
            vm->error = E_EXPERT;
            vm->detail = ids[i];
            vm->limit = experts;
            return;
        }
    /* Each expert's rows in order (a counting sort), gathered, multiplied, put back. */
    Py_ssize_t *order = malloc((size_t)(m + experts + 1) * sizeof(Py_ssize_t));
    float *xs = malloc((size_t)(m * k) * sizeof(float)), *ys = malloc((size_t)(m * n) * sizeof(float));
    if (!order || !xs || !ys) {
        vm->error = E_MEMORY;
        goto done;
    }
    Py_ssize_t *start = order + m; /* [experts + 1] */
    for (Py_ssize_t e = 0; e <= experts; e++) start[e] = 0;
    for (Py_ssize_t i = 0; i < m; i++) start[ids[i] + 1]++;
    for (Py_ssize_t e = 0; e < experts; e++) start[e + 1] += start[e];
    for (Py_ssize_t i = 0; i < m; i++) order[start[ids[i]]++] = i;
    for (Py_ssize_t e = experts; e > 0; e--) start[e] = start[e - 1]; /* the fills moved each start one group on */
    start[0] = 0;
    for (Py_ssize_t e = 0; e < experts && !vm->error; e++) {
        Py_ssize_t r0 = start[e], rows = start[e + 1] - r0;
        if (!rows) continue;
        for (Py_ssize_t r = 0; r < rows; r++) memcpy(xs + r * k, x + order[r0 + r] * k, (size_t)k * sizeof(float));
        if (bits < 0) {
            gemvf_run(xs, (const float *)(intptr_t)table[e], ys, rows, k, n);
        } else {
            const int64_t *w = table + 3 * e;
            if (gemv_run(bits, xs, (const uint8_t *)(intptr_t)w[0], (const void *)(intptr_t)w[1],
                         (const void *)(intptr_t)w[2], factor, half, ys, rows, k, n, group))
                vm->error = E_MEMORY;
        }
        for (Py_ssize_t r = 0; r < rows; r++) memcpy(out + order[r0 + r] * n, ys + r * n, (size_t)n * sizeof(float));
    }
done:
    free(order);
    free(xs);
    free(ys);
}

static void step(struct machine *vm) {
    int64_t op = next_int(vm);
    switch (op) {
    case OP_GEMV: {
        const float *x = next_ptr(vm);
        const uint8_t *codes = next_ptr(vm);
        const void *scales = next_ptr(vm), *biases = next_ptr(vm);
        float *out = next_ptr(vm);
        int bits = (int)next_int(vm);
        Py_ssize_t m = next_int(vm), k = next_int(vm), n = next_int(vm), group = next_int(vm);
        int half = (int)next_int(vm);
        float factor = (float)next_float(vm);
        if (!codes_ok(vm, bits & ~Q8_FLAG, group, k, half, biases) || m < 1 || n < 1) return;
        if (gemv_run(bits, x, codes, scales, biases, factor, half, out, m, k, n, group)) vm->error = E_MEMORY;
        return;
    }
    case OP_GEMV_F32: {
        const float *x = next_ptr(vm), *w = next_ptr(vm);
        float *out = next_ptr(vm);
        Py_ssize_t m = next_int(vm), k = next_int(vm), n = next_int(vm);
        if (!vm->error) gemvf_run(x, w, out, m, k, n);
        return;
    }
    case OP_RMS: {
        const float *x = next_ptr(vm), *w = next_ptr(vm);
        float *out = next_ptr(vm);
        const float *res = next_ptr(vm);
        float *h = next_ptr(vm);
        Py_ssize_t rows = next_int(vm), n = next_int(vm);
        float eps = (float)next_float(vm);
        if (!vm->error) rms_rows(x, w, out, rows, n, eps, res, h);
        return;
    }
    case OP_LAYERNORM: {
        const float *x = next_ptr(vm), *w = next_ptr(vm), *b = next_ptr(vm);
        float *out = next_ptr(vm);
        Py_ssize_t rows = next_int(vm), n = next_int(vm);
        float eps = (float)next_float(vm);
        if (!vm->error && (rows < 1 || n < 1 || (const float *)out == x)) vm->error = E_PROGRAM;
        if (!vm->error) layer_rows(x, w, b, out, rows, n, eps);
        return;
    }
    case OP_ROPE: {
        const float *x = next_ptr(vm), *c = next_ptr(vm), *s = next_ptr(vm);
        float *out = next_ptr(vm);
        Py_ssize_t t = next_int(vm), heads = next_int(vm), d = next_int(vm), half = next_int(vm);
        if (!vm->error) rope_rows(x, c, s, out, t, heads, d, half);
        return;
    }
    case OP_SCATTER_ROWS: {
        char *dst = next_ptr(vm);
        const int32_t *rows = next_ptr(vm);
        const char *src = next_ptr(vm);
        Py_ssize_t n = next_int(vm), row_bytes = next_int(vm), capacity = next_int(vm);
        int to_half = (int)next_int(vm);
        if (vm->error) return;
        for (Py_ssize_t i = 0; i < n; i++) /* every row checked before any is written */
            if (rows[i] < 0 || rows[i] >= capacity) {
                vm->error = E_SLOT;
                vm->detail = rows[i];
                vm->limit = capacity;
                return;
            }
        if (to_half == 2) { /* q8_0 blocks: row_bytes / Q8_0_BYTES of them a row, from 32 floats each */
            const Py_ssize_t blocks = row_bytes / Q8_0_BYTES;
            if (row_bytes % Q8_0_BYTES) {
                vm->error = E_PROGRAM;
                return;
            }
            for (Py_ssize_t i = 0; i < n; i++)
                q8_0_quantize((const float *)src + i * blocks * 32, (uint8_t *)dst + (Py_ssize_t)rows[i] * row_bytes,
                              blocks);
            return;
        }
        if (to_half) { /* row_bytes / 2 halves a row, from as many floats */
            const Py_ssize_t width = row_bytes / 2;
            for (Py_ssize_t i = 0; i < n; i++) {
                uint16_t *d = (uint16_t *)(dst + (Py_ssize_t)rows[i] * row_bytes);
                const float *f = (const float *)src + i * width;
                for (Py_ssize_t c = 0; c < width; c++) d[c] = float_to_half(f[c]);
            }
            return;
        }
        for (Py_ssize_t i = 0; i < n; i++)
            memcpy(dst + (Py_ssize_t)rows[i] * row_bytes, src + i * row_bytes, (size_t)row_bytes);
        return;
    }
    case OP_ATTENTION: step_attention(vm); return;
    case OP_GATHER: {
        const char *table = next_ptr(vm), *ids = next_ptr(vm);
        char *out = next_ptr(vm);
        Py_ssize_t count = next_int(vm), vocab = next_int(vm), row_bytes = next_int(vm);
        int64_t id_bytes = next_int(vm);
        const int error = next_int(vm) ? E_ROW : E_TOKEN;
        if (id_bytes != 4 && id_bytes != 8) vm->error = E_PROGRAM;
        for (Py_ssize_t i = 0; i < count && !vm->error; i++) {
            Py_ssize_t r = row_id(vm, ids, i, id_bytes, vocab, error);
            if (r >= 0) memcpy(out + i * row_bytes, table + r * row_bytes, (size_t)row_bytes);
        }
        return;
    }
    case OP_DEQUANT_ROWS: {
        const uint8_t *codes = next_ptr(vm);
        const void *scales = next_ptr(vm), *biases = next_ptr(vm);
        const char *ids = next_ptr(vm);
        float *out = next_ptr(vm);
        Py_ssize_t count = next_int(vm), vocab = next_int(vm);
        int bits = (int)next_int(vm);
        Py_ssize_t k = next_int(vm), group = next_int(vm);
        int half = (int)next_int(vm);
        int64_t id_bytes = next_int(vm);
        float factor = (float)next_float(vm);
        if (!codes_ok(vm, bits, group, k, half, biases) || (id_bytes != 4 && id_bytes != 8)) return;
        for (Py_ssize_t i = 0; i < count && !vm->error; i++) {
            Py_ssize_t r = row_id(vm, ids, i, id_bytes, vocab, E_TOKEN);
            if (r < 0) break;
            dequant_rows(bits, codes, scales, biases, factor, half, r, r + 1, k, group, out + i * k);
        }
        return;
    }
    case OP_COPY: step_copy(vm); return;
    case OP_UNARY: step_unary(vm); return;
    case OP_BINARY: step_binary(vm); return;
    case OP_REDUCE: step_reduce(vm); return;
    case OP_CONV1D: step_conv1d(vm); return;
    case OP_GDR: step_gdr(vm); return;
    case OP_SSD: step_ssd(vm); return;
    case OP_TOPK: step_topk(vm); return;
    case OP_EXPERT_GEMV: step_expert_gemv(vm); return;
    case OP_LORA: step_lora(vm); return;
    default: vm->error = E_PROGRAM; return;
    }
}

/* run_plan(code, floats, inputs, sizes) -> None: run the program `code`
 * (int64) with its float operands `floats` (float64) on `inputs` (a tuple of
 * C-contiguous writable arrays; sizes (int64): the bytes each must have). */
PyObject *run_plan(PyObject *self, PyObject *args) {
    Py_buffer code, floats, sizes;
    PyObject *inputs;
    if (!PyArg_ParseTuple(args, "y*y*O!y*", &code, &floats, &PyTuple_Type, &inputs, &sizes)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(inputs), held = 0;
    Py_buffer *views = calloc((size_t)(n ? n : 1), sizeof(Py_buffer));
    char **bases = calloc((size_t)(n ? n : 1), sizeof(char *));
    if (!views || !bases) {
        PyErr_NoMemory();
        goto done;
    }
    if (sizes.len != n * 8) {
        PyErr_Format(PyExc_ValueError, "run_plan: %zd inputs, %zd sizes", n, sizes.len / 8);
        goto done;
    }
    for (; held < n; held++) {
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(inputs, held), &views[held], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
            goto done;
        if (views[held].len != ((const int64_t *)sizes.buf)[held]) {
            PyErr_Format(PyExc_ValueError, "run_plan: input %zd has %zd bytes, the plan was made for %lld", held,
                         views[held].len, (long long)((const int64_t *)sizes.buf)[held]);
            held++;
            goto done;
        }
        bases[held] = views[held].buf;
    }
    struct machine vm = {(const int64_t *)code.buf, 0, code.len / 8, (const double *)floats.buf, 0, floats.len / 8,
                         bases, n, E_OK, 0, 0};
    Py_BEGIN_ALLOW_THREADS
    while (vm.pc < vm.size && !vm.error) step(&vm);
    Py_END_ALLOW_THREADS
    switch (vm.error) {
    case E_OK: result = Py_None; Py_INCREF(result); break;
    case E_MEMORY: PyErr_NoMemory(); break;
    case E_TOKEN:
        PyErr_Format(PyExc_IndexError, "token id %lld out of range [0, %lld)", vm.detail, vm.limit);
        break;
    case E_ROW:
        PyErr_Format(PyExc_IndexError, "row index %lld out of range [0, %lld)", vm.detail, vm.limit);
        break;
    case E_EXPERT:
        PyErr_Format(PyExc_IndexError, "a row is routed to expert %lld of %lld", vm.detail, vm.limit);
        break;
    case E_POSITION:
        PyErr_Format(PyExc_IndexError, "the step writes up to position %lld of a cache of %lld", vm.detail, vm.limit);
        break;
    case E_LENGTH:
        PyErr_Format(PyExc_IndexError, "attention over %lld keys of a cache of %lld", vm.detail, vm.limit);
        break;
    case E_ROWS:
        PyErr_Format(PyExc_IndexError, "attention over %lld keys for %lld query rows", vm.detail, vm.limit);
        break;
    case E_SLOT:
        PyErr_Format(PyExc_IndexError, "the step writes row %lld of a KV pool of %lld rows", vm.detail, vm.limit);
        break;
    case E_STATE:
        PyErr_Format(PyExc_IndexError, "the step updates state slot %lld of a pool of %lld", vm.detail, vm.limit);
        break;
    case E_BLOCK:
        PyErr_Format(PyExc_IndexError, "block table entry %lld is outside the pool of %lld blocks", vm.detail,
                     vm.limit);
        break;
    case E_BATCH:
        PyErr_Format(PyExc_IndexError, "a recurrent op's query_start or checkpoint rows do not fit its %lld rows",
                     vm.limit);
        break;
    case E_ADAPTER:
        PyErr_Format(PyExc_IndexError, "a row reads adapter slot %lld of pools of %lld slots", vm.detail, vm.limit);
        break;
    default: PyErr_Format(PyExc_ValueError, "run_plan: malformed program at %zd", vm.pc); break;
    }
done:
    for (Py_ssize_t i = 0; i < held; i++) PyBuffer_Release(&views[i]);
    free(views);
    free(bases);
    PyBuffer_Release(&code);
    PyBuffer_Release(&floats);
    PyBuffer_Release(&sizes);
    return result;
}

/* opcodes() -> {name: code}: the recorder's opcodes, from the table above. */
PyObject *opcodes(PyObject *self, PyObject *noargs) {
    PyObject *table = PyDict_New();
    if (!table) return NULL;
    for (size_t i = 0; i < sizeof OPCODES / sizeof OPCODES[0]; i++) {
        PyObject *code = PyLong_FromLong(OPCODES[i].code);
        if (!code || PyDict_SetItemString(table, OPCODES[i].name, code) < 0) {
            Py_XDECREF(code);
            Py_DECREF(table);
            return NULL;
        }
        Py_DECREF(code);
    }
    return table;
}
