/* The recurrent layers' ops (infer/ops.py, "Recurrent ops"): causal_conv1d,
 * gated_delta_rule and ssd over a ragged batch, float32, carrying each
 * sequence's state and writing it after each checkpoint row.
 *
 * Each op's work is written once, as always-inline bodies whose inner loops
 * run along a contiguous axis with no reduction across their iterations (the
 * sums that are reductions keep 16 partial sums in a fixed order), and
 * compiled three times: plain, and inside functions built for AVX2 and for
 * AVX-512 (kernels.h's target attributes), which the compiler vectorizes for
 * those instructions. With -ffp-contract=off no path fuses a multiply and an
 * add, so every path computes the same float32 values in the same order:
 * the forced paths (INFER_NUMPY_KERNELS) agree to the bit.
 *
 * Work is split across OpenMP threads by channels (the convolution), by
 * sequence and head (the scans). A decode step is the one-row case of each.
 *
 * gated_delta_rule runs a sequence's rows one of two ways (recurrent_gdr):
 * the recurrence row by row (decode, short runs), or the chunked form of
 * flash-linear-attention (Yang et al. 2024, "Parallelizing Linear
 * Transformers with the Delta Rule over Sequence Length": the UT transform
 * of each chunk's rows, then a chunk's outputs and state update as
 * products), for longer runs; chunks end at checkpoint rows so that the
 * state there is a chunk's state. ssd's recurrence keeps each head's state
 * in L1 a block of rows at a time. */

#include "kernels.h"

#define LANES 16 /* partial sums of a dot product */
#define GDR_CHUNK 64
/* State values updated in a call (rows plus sequences, times a state's size) worth the threads: a
 * decode step of one Qwen3.5 sequence (16 heads of 128 x 128) is 2^19 of them, 0.1 ms on one thread,
 * and goes to both (the workers are awake between a step's products: 1.04x its decode speed). */
#define PARALLEL_WORK (1 << 18)

/* -- shared pieces ------------------------------------------------------------------ */

/* sum_i a[i] * b[i] in 16 partial sums, added in a fixed order at the end. */
INLINE float dot16(const float *restrict a, const float *restrict b, Py_ssize_t n) {
    float acc[LANES] = {0};
    Py_ssize_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += a[i + l] * b[i + l];
    for (int l = 0; i < n; i++, l++) acc[l] += a[i] * b[i];
    float s = 0.0f;
    for (int l = 0; l < LANES; l++) s += acc[l];
    return s;
}

/* y[i] += a * x[i] */
INLINE void axpy(float *restrict y, float a, const float *restrict x, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) y[i] += a * x[i];
}

INLINE float silu1(float y) { return y / (1.0f + expf(-y)); }

/* PyTorch's softplus: x itself above 20. */
INLINE float softplus1(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

/* The checkpoints of rows [lo, hi) in row order: ck_order sorts the
 * checkpoint indices by row; *at is advanced past those before lo. */
INLINE Py_ssize_t first_checkpoint(const int32_t *rows, const int64_t *order, Py_ssize_t n, Py_ssize_t lo) {
    Py_ssize_t a = 0, b = n; /* the first in order whose row >= lo */
    while (a < b) {
        Py_ssize_t m = (a + b) / 2;
        if (rows[order[m]] < lo) a = m + 1;
        else b = m;
    }
    return a;
}

/* -- causal_conv1d --------------------------------------------------------------------- */


/* Row p of sequence b's inputs with its window before them (p < K - 1: the window's). */
INLINE const float *conv_in(const struct conv_args *a, Py_ssize_t b, Py_ssize_t start, Py_ssize_t p) {
    const Py_ssize_t w = a->K - 1;
    return p < w ? a->window + (b * w + p) * a->C : a->x + (start + p - w) * a->C;
}

/* Channels [c0, c1) of every row: the weighted sum of the K rows ending at
 * it, tap 0 first (numpy's sum over the taps), then the bias and activation. */
INLINE void conv_body(const struct conv_args *a, Py_ssize_t c0, Py_ssize_t c1) {
    const Py_ssize_t C = a->C, K = a->K, w = K - 1, n = c1 - c0;
    for (Py_ssize_t b = 0; b < a->nseq; b++) {
        const Py_ssize_t start = a->qs[b], stop = a->qs[b + 1];
        for (Py_ssize_t t = 0; t < stop - start; t++) {
            float *restrict y = a->y + (start + t) * C + c0;
            const float *in = conv_in(a, b, start, t);
            for (Py_ssize_t c = 0; c < n; c++) y[c] = a->wt[c0 + c] * in[c0 + c];
            for (Py_ssize_t j = 1; j < K; j++) {
                in = conv_in(a, b, start, t + j);
                const float *wj = a->wt + j * C + c0;
                for (Py_ssize_t c = 0; c < n; c++) y[c] += wj[c] * in[c0 + c];
            }
            if (a->bias)
                for (Py_ssize_t c = 0; c < n; c++) y[c] += a->bias[c0 + c];
            if (a->silu)
                for (Py_ssize_t c = 0; c < n; c++) y[c] = silu1(y[c]);
        }
        /* The window after the last row (the inputs' last K - 1, the window's where fewer). */
        const Py_ssize_t len = stop - start;
        for (Py_ssize_t p = 0; p < w; p++)
            memcpy(a->last + (b * w + p) * C + c0, conv_in(a, b, start, len + p) + c0, n * 4);
    }
    for (Py_ssize_t i = 0; i < a->nrows; i++) {
        const Py_ssize_t r = a->rows[i];
        Py_ssize_t b = 0;
        while (a->qs[b + 1] <= r) b++;
        const Py_ssize_t start = a->qs[b];
        for (Py_ssize_t p = 0; p < w; p++)
            memcpy(a->ckpt + (i * w + p) * C + c0, conv_in(a, b, start, r - start + 1 + p) + c0, n * 4);
    }
}

static void conv_portable(const struct conv_args *a, Py_ssize_t c0, Py_ssize_t c1) { conv_body(a, c0, c1); }
#ifdef HAVE_X86
AVX2 static void conv_avx2(const struct conv_args *a, Py_ssize_t c0, Py_ssize_t c1) { conv_body(a, c0, c1); }
AVX512 static void conv_512(const struct conv_args *a, Py_ssize_t c0, Py_ssize_t c1) { conv_body(a, c0, c1); }
#endif

void conv1d_run(const struct conv_args *a) {
    /* Spans of 64 channels (a cache line's floats times four), so threads never share a line. */
    const Py_ssize_t span = 64, spans = (a->C + span - 1) / span;
    #pragma omp parallel for schedule(static) if (a->parallel && spans > 1 && (a->qs[a->nseq] + a->nseq) * a->C > 16384)
    for (Py_ssize_t s = 0; s < spans; s++) {
        const Py_ssize_t c0 = s * span, c1 = c0 + span < a->C ? c0 + span : a->C;
#ifdef HAVE_X86
        if (use_avx512) conv_512(a, c0, c1);
        else if (use_avx2) conv_avx2(a, c0, c1);
        else
#endif
            conv_portable(a, c0, c1);
    }
}

/* Sequence b's row of a recurrent op's state (and of its last state): its slot where the op
 * reads and writes a pool in place (a captured step, record.py), else b. */
INLINE Py_ssize_t state_row(const int32_t *slots, Py_ssize_t b) { return slots ? slots[b] : b; }

/* -- gated_delta_rule -------------------------------------------------------------------- */


#define GDR_VB 32 /* value columns of a state block kept in L1 by the recurrence */

/* The recurrence over rows [lo, hi) of one head, value columns [v0, v0 + vb),
 * the state block S [K][vb] (rows `stride` floats apart) in place; as the
 * reference orders it: decay, recall, the delta, the update, the read-out. */
INLINE void gdr_rows(const struct gdr_args *a, Py_ssize_t h, Py_ssize_t v0, Py_ssize_t vb, float *restrict S,
                     Py_ssize_t stride, Py_ssize_t lo, Py_ssize_t hi) {
    const Py_ssize_t K = a->K, V = a->V, H = a->H, j = h / (H / a->Hk);
    float mem[GDR_VB], out[GDR_VB], delta[GDR_VB];
    for (Py_ssize_t t = lo; t < hi; t++) {
        const float d = expf(a->g[t * H + h]), beta = a->beta[t * H + h];
        const float *kt = a->k + (t * a->Hk + j) * K, *qt = a->q + (t * a->Hk + j) * K;
        const float *vt = a->v + (t * H + h) * V + v0;
        for (Py_ssize_t c = 0; c < vb; c++) mem[c] = out[c] = 0.0f;
        for (Py_ssize_t i = 0; i < K; i++) {
            float *restrict s = S + i * stride;
            for (Py_ssize_t c = 0; c < vb; c++) {
                s[c] *= d;
                mem[c] += s[c] * kt[i];
            }
        }
        for (Py_ssize_t c = 0; c < vb; c++) delta[c] = (vt[c] - mem[c]) * beta;
        for (Py_ssize_t i = 0; i < K; i++) {
            float *restrict s = S + i * stride;
            for (Py_ssize_t c = 0; c < vb; c++) {
                s[c] += kt[i] * delta[c];
                out[c] += s[c] * qt[i];
            }
        }
        memcpy(a->o + (t * H + h) * V + v0, out, vb * 4);
    }
}

/* The state block [K][vb] of a [K][V] state (S's rows `stride` floats apart), out of it or into it. */
INLINE void block_in(float *restrict S, const float *src, Py_ssize_t K, Py_ssize_t V, Py_ssize_t v0, Py_ssize_t vb) {
    for (Py_ssize_t i = 0; i < K; i++) memcpy(S + i * vb, src + i * V + v0, vb * 4);
}
INLINE void block_out(const float *S, Py_ssize_t stride, float *dst, Py_ssize_t K, Py_ssize_t V, Py_ssize_t v0,
                      Py_ssize_t vb) {
    for (Py_ssize_t i = 0; i < K; i++) memcpy(dst + i * V + v0, S + i * stride, vb * 4);
}

/* Sequence b, head h, columns [v0, v0 + vb) by the recurrence, the states at checkpoints written.
 * Where the op updates its state in place (a captured step's pool, record.py), the block is
 * worked on where it lies: its 128-byte rows fill as many L1 lines as a copy's would. */
INLINE void gdr_recurrent_body(const struct gdr_args *a, Py_ssize_t b, Py_ssize_t h, Py_ssize_t v0, Py_ssize_t vb) {
    const Py_ssize_t K = a->K, V = a->V, H = a->H, KV = K * V;
    float copy[GDR_MAX_K * GDR_VB], *S = copy;
    Py_ssize_t stride = vb;
    float *last = a->last + (state_row(a->slots, b) * H + h) * KV;
    if (a->state == a->last) {
        S = last + v0;
        stride = V;
    } else {
        block_in(S, a->state + (state_row(a->slots, b) * H + h) * KV, K, V, v0, vb);
    }
    const Py_ssize_t start = a->qs[b], stop = a->qs[b + 1];
    Py_ssize_t at = first_checkpoint(a->rows, a->order, a->nrows, start), t = start;
    while (t < stop) {
        Py_ssize_t end = stop;
        if (at < a->nrows && a->rows[a->order[at]] < stop) end = a->rows[a->order[at]] + 1;
        if (vb == GDR_VB) gdr_rows(a, h, v0, GDR_VB, S, stride, t, end); /* the loops' length a constant: unrolled */
        else gdr_rows(a, h, v0, vb, S, stride, t, end);
        for (; at < a->nrows && a->rows[a->order[at]] == end - 1; at++)
            block_out(S, stride, a->ckpt + (a->order[at] * H + h) * KV, K, V, v0, vb);
        t = end;
    }
    if (S == copy) block_out(S, stride, last, K, V, v0, vb);
}

/* Scratch of the chunked form for one (sequence, head): see gdr_chunk. */
struct gdr_scratch {
    float *S, *A, *P, *U, *W, *kb, *gc;
};

/* One chunk of rows [t0, t0 + n) of head h, the state S [K][V] in place
 * (transformers' torch_chunk_gated_delta_rule, per chunk):
 *   gc     the decay's log summed from the chunk's start through each row
 *   A      (I + strictly-lower(beta_i k_i.k_j exp(gc_i - gc_j)))^-1, by rows
 *   U, W   A (beta v), A (beta k exp(gc)): the UT transform
 *   U      U - W S: each row's delta beta_t (v_t - S_{t-1}^T k_t)
 *   o_i    (q_i exp(gc_i)) S + sum_{j <= i} (q_i.k_j) exp(gc_i - gc_j) delta_j
 *   S      exp(gc_last) S + sum_j (k_j exp(gc_last - gc_j)) delta_j^T */
INLINE void gdr_chunk(const struct gdr_args *a, Py_ssize_t h, Py_ssize_t t0, Py_ssize_t n,
                      const struct gdr_scratch *w, const Py_ssize_t K, const Py_ssize_t V) {
    const Py_ssize_t H = a->H, Hk = a->Hk, j0 = h / (H / Hk);
    float *restrict S = w->S, *restrict A = w->A, *restrict P = w->P, *restrict U = w->U, *restrict W = w->W,
                    *restrict kb = w->kb, *restrict gc = w->gc;
#define KROW(t) (a->k + ((t) * Hk + j0) * K)
#define QROW(t) (a->q + ((t) * Hk + j0) * K)
    float acc = 0.0f;
    for (Py_ssize_t i = 0; i < n; i++) gc[i] = acc += a->g[(t0 + i) * H + h];
    /* A's strictly lower part, row by row, each row solved against those above it. */
    for (Py_ssize_t i = 0; i < n; i++) {
        float *restrict r = A + i * GDR_CHUNK;
        const float bi = a->beta[(t0 + i) * H + h];
        for (Py_ssize_t j = 0; j < i; j++) r[j] = -(bi * dot16(KROW(t0 + i), KROW(t0 + j), K)) * expf(gc[i] - gc[j]);
        /* r = r + r @ A[:i, :i] (rows above already solved), as transformers' loop */
        float add[GDR_CHUNK];
        for (Py_ssize_t j = 0; j < i; j++) add[j] = 0.0f;
        for (Py_ssize_t m = 1; m < i; m++) axpy(add, r[m], A + m * GDR_CHUNK, m); /* row m's entries left of m */
        for (Py_ssize_t j = 0; j < i; j++) r[j] += add[j];
        r[i] = 1.0f;
        for (Py_ssize_t j = i + 1; j < n; j++) r[j] = 0.0f;
    }
    /* U = A (beta v), W = A (beta k exp(gc)) */
    for (Py_ssize_t i = 0; i < n; i++) {
        float *restrict u = U + i * V, *restrict wr = W + i * K;
        memset(u, 0, V * 4);
        memset(wr, 0, K * 4);
        for (Py_ssize_t j = 0; j <= i; j++) {
            const float bj = a->beta[(t0 + j) * H + h], aij = A[i * GDR_CHUNK + j];
            const float *vj = a->v + ((t0 + j) * H + h) * V, *kj = KROW(t0 + j);
            const float cu = aij * bj, cw = aij * (bj * expf(gc[j]));
            axpy(u, cu, vj, V);
            axpy(wr, cw, kj, K);
        }
    }
    /* U -= W S: the deltas */
    for (Py_ssize_t i = 0; i < n; i++)
        for (Py_ssize_t kk = 0; kk < K; kk++) axpy(U + i * V, -W[i * K + kk], S + kk * V, V);
    /* P = the causal q.k scores with their decays */
    for (Py_ssize_t i = 0; i < n; i++)
        for (Py_ssize_t j = 0; j <= i; j++)
            P[i * GDR_CHUNK + j] = dot16(QROW(t0 + i), KROW(t0 + j), K) * expf(gc[i] - gc[j]);
    /* o = (q exp(gc)) S + P U */
    for (Py_ssize_t i = 0; i < n; i++) {
        float *restrict o = a->o + ((t0 + i) * H + h) * V;
        const float *qi = QROW(t0 + i), e = expf(gc[i]);
        memset(o, 0, V * 4);
        for (Py_ssize_t kk = 0; kk < K; kk++) axpy(o, qi[kk] * e, S + kk * V, V);
        for (Py_ssize_t j = 0; j <= i; j++) axpy(o, P[i * GDR_CHUNK + j], U + j * V, V);
    }
    /* S = exp(gc_last) S + sum_j (k_j exp(gc_last - gc_j)) U_j^T */
    const float glast = gc[n - 1], el = expf(glast);
    for (Py_ssize_t j = 0; j < n; j++) {
        const float e = expf(glast - gc[j]), *kj = KROW(t0 + j);
        for (Py_ssize_t kk = 0; kk < K; kk++) kb[j * K + kk] = kj[kk] * e;
    }
    for (Py_ssize_t kk = 0; kk < K; kk++) {
        float *restrict s = S + kk * V;
        for (Py_ssize_t c = 0; c < V; c++) s[c] *= el;
        for (Py_ssize_t j = 0; j < n; j++) axpy(s, kb[j * K + kk], U + j * V, V);
    }
#undef KROW
#undef QROW
}

/* Sequence b, head h, all columns by chunks ending at checkpoint rows. */
INLINE void gdr_chunked_body(const struct gdr_args *a, Py_ssize_t b, Py_ssize_t h, const struct gdr_scratch *w) {
    const Py_ssize_t K = a->K, V = a->V, H = a->H, KV = K * V;
    memcpy(w->S, a->state + (state_row(a->slots, b) * H + h) * KV, KV * 4);
    const Py_ssize_t start = a->qs[b], stop = a->qs[b + 1];
    Py_ssize_t at = first_checkpoint(a->rows, a->order, a->nrows, start), t = start;
    while (t < stop) {
        Py_ssize_t end = t + GDR_CHUNK < stop ? t + GDR_CHUNK : stop;
        if (at < a->nrows && a->rows[a->order[at]] < end) end = a->rows[a->order[at]] + 1;
        if (K == 128 && V == 128) gdr_chunk(a, h, t, end - t, w, 128, 128); /* Qwen3.5's and Qwen3-Next's heads */
        else gdr_chunk(a, h, t, end - t, w, K, V);
        for (; at < a->nrows && a->rows[a->order[at]] == end - 1; at++)
            memcpy(a->ckpt + (a->order[at] * H + h) * KV, w->S, KV * 4);
        t = end;
    }
    memcpy(a->last + (state_row(a->slots, b) * H + h) * KV, w->S, KV * 4);
}

static void gdr_recurrent_portable(const struct gdr_args *a, Py_ssize_t b, Py_ssize_t h, Py_ssize_t v0,
                                   Py_ssize_t vb) {
    gdr_recurrent_body(a, b, h, v0, vb);
}
static void gdr_chunked_portable(const struct gdr_args *a, Py_ssize_t b, Py_ssize_t h, const struct gdr_scratch *w) {
    gdr_chunked_body(a, b, h, w);
}
#ifdef HAVE_X86
AVX2 static void gdr_recurrent_avx2(const struct gdr_args *a, Py_ssize_t b, Py_ssize_t h, Py_ssize_t v0,
                                    Py_ssize_t vb) {
    gdr_recurrent_body(a, b, h, v0, vb);
}
AVX2 static void gdr_chunked_avx2(const struct gdr_args *a, Py_ssize_t b, Py_ssize_t h, const struct gdr_scratch *w) {
    gdr_chunked_body(a, b, h, w);
}
AVX512 static void gdr_recurrent_512(const struct gdr_args *a, Py_ssize_t b, Py_ssize_t h, Py_ssize_t v0,
                                     Py_ssize_t vb) {
    gdr_recurrent_body(a, b, h, v0, vb);
}
AVX512 static void gdr_chunked_512(const struct gdr_args *a, Py_ssize_t b, Py_ssize_t h, const struct gdr_scratch *w) {
    gdr_chunked_body(a, b, h, w);
}
#endif

/* 0, or -1 where scratch memory could not be had. */
int gdr_run(const struct gdr_args *a) {
    const Py_ssize_t H = a->H, K = a->K, V = a->V;
    const Py_ssize_t vblocks = (V + GDR_VB - 1) / GDR_VB, tasks = a->nseq * H * vblocks;
    int failed = 0, any_chunked = 0;
    for (Py_ssize_t b = 0; b < a->nseq; b++) any_chunked |= a->chunked && a->qs[b + 1] - a->qs[b] >= a->chunked;
    /* The recurrence for every sequence whose run is short (all of a decode step), by blocks of
     * columns; on one thread below PARALLEL_WORK. */
    #pragma omp parallel for schedule(dynamic, 1) if (a->parallel && tasks > 1 && (a->qs[a->nseq] + a->nseq) * H * K * V >= PARALLEL_WORK)
    for (Py_ssize_t task = 0; task < tasks; task++) {
        const Py_ssize_t b = task / (H * vblocks), h = task / vblocks % H, v0 = task % vblocks * GDR_VB;
        const Py_ssize_t len = a->qs[b + 1] - a->qs[b];
        if (a->chunked && len >= a->chunked) continue;
        const Py_ssize_t vb = v0 + GDR_VB < V ? GDR_VB : V - v0;
#ifdef HAVE_X86
        if (use_avx512) gdr_recurrent_512(a, b, h, v0, vb);
        else if (use_avx2) gdr_recurrent_avx2(a, b, h, v0, vb);
        else
#endif
            gdr_recurrent_portable(a, b, h, v0, vb);
    }
    if (!any_chunked) return 0;
    const Py_ssize_t heads = a->nseq * H;
    const size_t each = (size_t)(K * V + 2 * GDR_CHUNK * GDR_CHUNK + GDR_CHUNK * V + 2 * GDR_CHUNK * K + GDR_CHUNK);
    #pragma omp parallel if (a->parallel && heads > 1)
    {
        float *buf = NULL;
        #pragma omp for schedule(dynamic, 1)
        for (Py_ssize_t task = 0; task < heads; task++) {
            const Py_ssize_t b = task / H, h = task % H;
            if (a->qs[b + 1] - a->qs[b] < a->chunked) continue;
            if (!buf && !(buf = malloc(each * 4))) {
                #pragma omp atomic write
                failed = 1;
                continue;
            }
            const struct gdr_scratch w = {buf, buf + K * V, buf + K * V + GDR_CHUNK * GDR_CHUNK,
                                          buf + K * V + 2 * GDR_CHUNK * GDR_CHUNK,
                                          buf + K * V + 2 * GDR_CHUNK * GDR_CHUNK + GDR_CHUNK * V,
                                          buf + K * V + 2 * GDR_CHUNK * GDR_CHUNK + GDR_CHUNK * V + GDR_CHUNK * K,
                                          buf + K * V + 2 * GDR_CHUNK * GDR_CHUNK + GDR_CHUNK * V + 2 * GDR_CHUNK * K};
#ifdef HAVE_X86
            if (use_avx512) gdr_chunked_512(a, b, h, &w);
            else if (use_avx2) gdr_chunked_avx2(a, b, h, &w);
            else
#endif
                gdr_chunked_portable(a, b, h, &w);
        }
        free(buf);
    }
    return failed ? -1 : 0;
}

/* q and k divided by sqrt(|x|^2 + 1e-6) where l2norm (transformers' l2norm), then q times scale. */
void gdr_prepare(const float *q, const float *k, float *qn, float *kn, Py_ssize_t rows, Py_ssize_t K, float scale,
                 int l2norm) {
    #pragma omp parallel for schedule(static) if (rows * K > 65536)
    for (Py_ssize_t r = 0; r < rows; r++) {
        const float *qr = q + r * K, *kr = k + r * K;
        float *qo = qn + r * K, *ko = kn + r * K;
        float nq = 1.0f, nk = 1.0f;
        if (l2norm) {
            nq = sqrtf(dot16(qr, qr, K) + 1e-6f);
            nk = sqrtf(dot16(kr, kr, K) + 1e-6f);
        }
        for (Py_ssize_t i = 0; i < K; i++) {
            qo[i] = (l2norm ? qr[i] / nq : qr[i]) * scale;
            ko[i] = l2norm ? kr[i] / nk : kr[i];
        }
    }
}

/* -- ssd ----------------------------------------------------------------------------------- */


#define SSD_PB 16 /* head rows of the state kept in L1 by a task */

/* Sequence b, head h, head rows [p0, p0 + pb): the recurrence row by row, as
 * the reference orders it (decay times the state plus dt x outer B, then
 * the read-out against C), the state block [pb][N] on the stack. */
INLINE void ssd_body(const struct ssd_args *a, Py_ssize_t b, Py_ssize_t h, Py_ssize_t p0, Py_ssize_t pb,
                     const Py_ssize_t N) {
    const Py_ssize_t H = a->H, P = a->P, PN = P * N, g = h / (H / a->G);
    float S[SSD_PB * SSD_MAX_N];
    memcpy(S, a->state + (state_row(a->slots, b) * H + h) * PN + p0 * N, pb * N * 4);
    const Py_ssize_t start = a->qs[b], stop = a->qs[b + 1];
    Py_ssize_t at = first_checkpoint(a->rows, a->order, a->nrows, start);
    const float A = a->A[h], Dh = a->D ? a->D[h] : 0.0f;
    for (Py_ssize_t t = start; t < stop; t++) {
        const float dt = a->step[t * H + h], decay = expf(dt * A);
        const float *Bt = a->B + (t * a->G + g) * N, *Ct = a->C + (t * a->G + g) * N;
        const float *xt = a->x + (t * H + h) * P + p0;
        float *yt = a->y + (t * H + h) * P + p0;
        for (Py_ssize_t p = 0; p < pb; p++) {
            float *restrict s = S + p * N;
            const float u = dt * xt[p];
            for (Py_ssize_t n = 0; n < N; n++) s[n] = decay * s[n] + u * Bt[n];
            yt[p] = dot16(s, Ct, N);
            if (a->D) yt[p] += Dh * xt[p];
        }
        for (; at < a->nrows && a->rows[a->order[at]] == t; at++)
            memcpy(a->ckpt + (a->order[at] * H + h) * PN + p0 * N, S, pb * N * 4);
    }
    memcpy(a->last + (state_row(a->slots, b) * H + h) * PN + p0 * N, S, pb * N * 4);
}

static void ssd_portable(const struct ssd_args *a, Py_ssize_t b, Py_ssize_t h, Py_ssize_t p0, Py_ssize_t pb) {
    if (a->N == 128) ssd_body(a, b, h, p0, pb, 128); /* Mamba2's and Granite 4.0-H's state size */
    else ssd_body(a, b, h, p0, pb, a->N);
}
#ifdef HAVE_X86
AVX2 static void ssd_avx2(const struct ssd_args *a, Py_ssize_t b, Py_ssize_t h, Py_ssize_t p0, Py_ssize_t pb) {
    if (a->N == 128) ssd_body(a, b, h, p0, pb, 128); /* Mamba2's and Granite 4.0-H's state size */
    else ssd_body(a, b, h, p0, pb, a->N);
}
AVX512 static void ssd_512(const struct ssd_args *a, Py_ssize_t b, Py_ssize_t h, Py_ssize_t p0, Py_ssize_t pb) {
    if (a->N == 128) ssd_body(a, b, h, p0, pb, 128); /* Mamba2's and Granite 4.0-H's state size */
    else ssd_body(a, b, h, p0, pb, a->N);
}
#endif

void ssd_run(const struct ssd_args *a) {
    const Py_ssize_t pblocks = (a->P + SSD_PB - 1) / SSD_PB, tasks = a->nseq * a->H * pblocks;
    #pragma omp parallel for schedule(dynamic, 1) if (a->parallel && tasks > 1 && (a->qs[a->nseq] + a->nseq) * a->H * a->P * a->N >= PARALLEL_WORK)
    for (Py_ssize_t task = 0; task < tasks; task++) {
        const Py_ssize_t b = task / (a->H * pblocks), h = task / pblocks % a->H, p0 = task % pblocks * SSD_PB;
        const Py_ssize_t pb = p0 + SSD_PB < a->P ? SSD_PB : a->P - p0;
#ifdef HAVE_X86
        if (use_avx512) ssd_512(a, b, h, p0, pb);
        else if (use_avx2) ssd_avx2(a, b, h, p0, pb);
        else
#endif
            ssd_portable(a, b, h, p0, pb);
    }
}

/* dt + dt_bias, softplus (where asked), clamped: ssd's step sizes [rows]. */
void ssd_steps(const float *dt, const float *bias, float *step, Py_ssize_t T, Py_ssize_t H, int softplus, float lo,
               float hi) {
    for (Py_ssize_t t = 0; t < T; t++)
        for (Py_ssize_t h = 0; h < H; h++) {
            float s = dt[t * H + h] + (bias ? bias[h] : 0.0f);
            if (softplus) s = softplus1(s);
            step[t * H + h] = s < lo ? lo : s > hi ? hi : s;
        }
}

/* Whether a batch read from a step's inputs fits its T rows (query_start
 * rising from 0 to T, each checkpoint row one of them), and its checkpoint
 * indices in row order into `order` (a stable insertion sort: a step has few). */
int recurrent_batch(const int32_t *qs, Py_ssize_t nseq, Py_ssize_t T, const int32_t *rows, Py_ssize_t nrows,
                    int64_t *order) {
    if (nseq < 1 || qs[0] != 0 || qs[nseq] != T) return 0;
    for (Py_ssize_t b = 0; b < nseq; b++)
        if (qs[b + 1] < qs[b]) return 0;
    for (Py_ssize_t i = 0; i < nrows; i++) {
        if (rows[i] < 0 || rows[i] >= T) return 0;
        Py_ssize_t j = i;
        for (; j > 0 && rows[order[j - 1]] > rows[i]; j--) order[j] = order[j - 1];
        order[j] = i;
    }
    return 1;
}
