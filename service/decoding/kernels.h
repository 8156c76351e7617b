/* What the compiled kernels share (attention.c, output_layer.c, middle.c, ...): GCC's generic vectors of 16
 * floats (lowered to AVX-512, AVX2 or SSE by each target clone), exp and tanh on them, the rows split
 * between threads, and reading numpy arrays through the buffer protocol. */
#ifndef NMT_KERNELS_H
#define NMT_KERNELS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define LANES 16
/* One build for every x86-64 CPU: each kernel compiled for AVX-512, AVX2 + FMA and the baseline, the
 * clone chosen at load. NMT_TARGET builds one of them alone (tests/test_fused_attention.py checks
 * each clone's results on any CPU that can run it). */
#ifdef NMT_TARGET
#define CLONES __attribute__((target(NMT_TARGET)))
#else
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
typedef float vf __attribute__((vector_size(LANES * 4)));
typedef int32_t vi __attribute__((vector_size(LANES * 4)));

static inline __attribute__((always_inline)) vf splat(float x) { return (vf){0} + x; }

static inline __attribute__((always_inline)) vf select_v(vi mask, vf yes, vf no) {
    return (vf)(((vi)yes & mask) | ((vi)no & ~mask));
}

/* e^y for y <= 0 (below -87: e^-87, about 1.6e-38): Cody-Waite reduction by ln 2, a degree-7 Taylor
 * polynomial on [-ln2/2, ln2/2] (relative error about 1e-7), 2^n through the exponent bits. */
static inline __attribute__((always_inline)) vf exp_v(vf y) {
    y = select_v(y < -87.0f, splat(-87.0f), y);
    vf n = (y * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round(y / ln 2) */
    vf r = y - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    vf p = splat(1.0f / 5040.0f);
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    vi bits = (__builtin_convertvector(n, vi) + 127) << 23; /* 2^n */
    return p * (vf)bits;
}

/* tanh(x) = sign(x) (1 - e) / (1 + e), e = exp(-2 |x|), |x| clamped at 9 (tanh(9) is 1 in float):
 * absolute error about 1e-7 */
static inline __attribute__((always_inline)) vf tanh_v(vf x) {
    vi sign = (vi)x & (int32_t)0x80000000;
    vf ax = (vf)((vi)x & 0x7fffffff);
    ax = select_v(ax > 9.0f, splat(9.0f), ax);
    vf e = exp_v(ax * -2.0f);
    vf t = (1.0f - e) / (1.0f + e);
    return (vf)((vi)t | sign);
}

/* 1 / (1 + e^-x) through e^-|x| (never overflowing) */
static inline __attribute__((always_inline)) vf sigmoid_v(vf x) {
    vi negative = (vi)x & (int32_t)0x80000000;
    vf e = exp_v((vf)((vi)x | (int32_t)0x80000000)); /* e^-|x| */
    return select_v(negative != 0, e / (1.0f + e), 1.0f / (1.0f + e));
}

#define MAX_K 256 /* the most log-probabilities an output kernel keeps per row */

static inline __attribute__((unused)) int any(vi mask) {
    uint64_t words[LANES / 2];
    memcpy(words, &mask, sizeof words);
    uint64_t all = 0;
    for (int i = 0; i < LANES / 2; i++) all |= words[i];
    return all != 0;
}

/* x (id v) into the k best so far (best[0] the largest), in whatever order they come: ties to the lower id
 * (ONNX Runtime's TopK) */
static inline __attribute__((unused)) void offer(float *best, int64_t *ids, int64_t *have, int64_t k, float x, int64_t v) {
    if (*have == k && !(x > best[k - 1] || (x == best[k - 1] && v < ids[k - 1]))) return;
    int64_t i = *have < k ? (*have)++ : k - 1;
    while (i > 0 && (x > best[i - 1] || (x == best[i - 1] && v < ids[i - 1]))) {
        best[i] = best[i - 1];
        ids[i] = ids[i - 1];
        i--;
    }
    best[i] = x;
    ids[i] = v;
}

static inline float hsum(vf acc) { /* the 16 lanes summed in a fixed order */
    float lane[LANES];
    memcpy(lane, &acc, sizeof lane);
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++) lane[l] += lane[l + w];
    return lane[0];
}

/* fn(ctx, first, last) over rows [0, rows) cut into `threads` parts of about equal weight (row r weighs
 * min(weights[r], cap), or 1 without weights), each but the first on a thread of its own (at least
 * ROWS_PER_THREAD rows each; a thread that cannot start leaves its part to the caller). */
typedef void (*RowsFn)(const void *ctx, int64_t first, int64_t last);
void run_rows(RowsFn fn, const void *ctx, int64_t rows, const int64_t *weights, int64_t cap, int threads);
/* run_rows without the GIL, then None; NULL with a MemoryError where a part set *failed (read after all ended) */
PyObject *run_rows_released(RowsFn fn, const void *ctx, int64_t rows, const int64_t *weights, int64_t cap, int threads,
                            const int *failed);

/* A C-contiguous numpy array of `ndim` dimensions and items `fmt` ('f' float32, 'i' int32, 'q' int64, 'H' float16 as
 * its bits), or -1 with
 * a ValueError naming it. */
int get_buffer(PyObject *obj, Py_buffer *view, int ndim, char fmt, int writable, const char *name);

/* The n arrays of the sequence `arrays` into b (zeroed by the caller), each as get_buffer reads it (writable from
 * index `outputs` on); None where optional(i) allows it (b[i] stays empty). 0, or -1 with an exception set
 * ("<who>: ..."); either way the caller releases b with release_buffers. */
int get_buffers(PyObject *arrays, Py_buffer *b, int n, const int *ndims, const char *fmts, const char *const *names,
                int outputs, int (*optional)(int i), const char *who);
void release_buffers(Py_buffer *b, int n);

/* An int8 product's constants (middle.c): out = (u . W - 128 colsum) * mult + bias, u as u8 quads */
typedef struct {
    int64_t K4, Jp, J;         /* input quads; columns as stored (a multiple of 64) and as output */
    const int32_t *panels;     /* (Jp / 64, K4, 64): column j's s8 quad k in panel j / 64 */
    const int32_t *colsum;     /* (Jp,) 128 x the sum of column j's weights */
    const float *mult, *bias;  /* (Jp,): a scale x column scale; bias or NULL */
} Product;

/* out (n, J) = the product of u (n rows of K4 quads); form 2 AVX-512 VNNI, 0 plain C: the same bits */
void int8_product(const Product *p, int64_t n, const int32_t *u, float *out, int form);

/* The Product of the buffers w[0..3] (panels (ceil(J / 64), K4, 64); colsum, mult and bias of the padded columns,
 * bias.buf NULL for none), or -1 with a ValueError naming `who`'s `name` */
int product_view(const Py_buffer *w, const char *who, const char *name, int64_t K4, int64_t J, Product *p);

/* The products' form: -1 asks for the best here (2 with AVX-512 VNNI, else 0); another this CPU cannot run is -1
 * with a ValueError naming `who` */
int product_form(const char *who, int form);

/* ONNX Runtime's QuantizeLinear to u8 around 128: x / scale, clamped, rounded to even */
void quantize_u8(int64_t n, const float *x, float scale, uint8_t *q);

/* The best form of exact int8 products this CPU has: 2 AVX-512 VNNI, 1 AVX2, 0 plain C (encoder.c). */
int int8_best_form(void);

PyObject *py_output_layer(PyObject *self, PyObject *args);
PyObject *py_shortlist_layer(PyObject *self, PyObject *args);
PyObject *py_gru_encode(PyObject *self, PyObject *args);
PyObject *py_gru_form(PyObject *self, PyObject *args);
PyObject *py_middle(PyObject *self, PyObject *args);
PyObject *py_shortlist_words(PyObject *self, PyObject *args);
PyObject *py_encoder_rest(PyObject *self, PyObject *args);
PyObject *py_state_product(PyObject *self, PyObject *args);

#endif
