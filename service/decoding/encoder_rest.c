/* The int8 encoder's rest after its GRU as one compiled kernel: every source position's attention keys and
 * the decoder's initial state (service/decoding/fused_encoder.py reads the constants from the encoder graph).
 * Each is a product of a row quantized on its own, as the graph computes it:
 *   s = max(max |x|, tiny) / qmax, q = QuantizeLinear(x * (1 / s))      (u8 around 128)
 *   y = ((q . W) * w) * s + b             (MatMulIntegerToFloat, Mul, Add; middle.c's products)
 * keys[b, t] from x = annotations[b, t] for t < lengths[b] (a padding position gets b, what the graph computes from
 * the zero rows the GRU kernel writes there): the graph's bits as written (ONNX Runtime's without its graph
 * optimizations, whose fusions move them by a rounding). init_state[b] = tanh(y) from x = annotations[b, 0,
 * offset : offset + K] (the backward direction's last state); its tanh is kernels.h's, not ONNX Runtime's.
 * Forms as middle.c's (the same bits); rows split between threads by their lengths.
 */
#pragma GCC optimize("fp-contract=off")
#include <stdlib.h>

#include "kernels.h"

typedef struct {
    int64_t B, T, C, offset;
    const float *ann;       /* (B, T, C) */
    const int64_t *lengths; /* (B,) */
    Product keys, init;        /* their products alone: acc * mult, no bias */
    const float *keys_bias, *init_bias; /* added after the row's scale */
    float qmax, tiny;
    float *out_keys, *out_init; /* (B, T, A), (B, S) */
    int form, failed;
} Rest;

/* x (K floats, K a multiple of 16) quantized on its own into q (u8 around 128); its scale s */
CLONES static float row_quantize(int64_t K, const float *x, uint8_t *q, float qmax, float tiny, float *scaled) {
    vf top = splat(0.0f);
    for (int64_t j = 0; j < K; j += LANES) {
        vf v;
        memcpy(&v, x + j, sizeof v);
        v = (vf)((vi)v & 0x7fffffff);
        top = select_v(v > top, v, top);
    }
    float lane[LANES], most = 0.0f;
    memcpy(lane, &top, sizeof lane);
    for (int l = 0; l < LANES; l++) most = lane[l] > most ? lane[l] : most;
    float s = (most > tiny ? most : tiny) / qmax, inverse = 1.0f / s;
    for (int64_t j = 0; j < K; j += LANES) {
        vf v;
        memcpy(&v, x + j, sizeof v);
        v = v * inverse;
        memcpy(scaled + j, &v, sizeof v);
    }
    quantize_u8(K, scaled, 1.0f, q);
    return s;
}

/* out (J) = y * s + bias, then tanh where asked (J a multiple of 16) */
CLONES static void scaled_row(int64_t J, const float *y, float s, const float *bias, float *out, int tanh) {
    for (int64_t j = 0; j < J; j += LANES) {
        vf v, b;
        memcpy(&v, y + j, sizeof v);
        memcpy(&b, bias + j, sizeof b);
        v = v * s;
        v = v + b;
        if (tanh) v = tanh_v(v);
        memcpy(out + j, &v, sizeof v);
    }
}

static void rest_rows(const void *ctx, int64_t first, int64_t last) {
    Rest *g = (Rest *)ctx;
    int64_t T = g->T, C = g->C, A = g->keys.J, S = g->init.J, K4 = g->keys.K4, n = 0;
    for (int64_t b = first; b < last; b++) n += g->lengths[b];
    int64_t rows = n > last - first ? n : last - first, width = A > S ? A : S;
    int32_t *u = calloc((size_t)(rows * (K4 > g->init.K4 ? K4 : g->init.K4)), sizeof(int32_t));
    float *scale = malloc((size_t)rows * sizeof(float)), *y = malloc((size_t)(rows * width) * sizeof(float));
    float *scaled = malloc((size_t)C * sizeof(float));
    if (!u || !scale || !y || !scaled) {
        g->failed = 1;
    } else {
        int64_t i = 0;
        for (int64_t b = first; b < last; b++)
            for (int64_t t = 0; t < g->lengths[b]; t++, i++)
                scale[i] = row_quantize(C, g->ann + (b * T + t) * C, (uint8_t *)(u + i * K4), g->qmax, g->tiny, scaled);
        int8_product(&g->keys, n, u, y, g->form);
        i = 0;
        for (int64_t b = first; b < last; b++)
            for (int64_t t = 0; t < T; t++) {
                float *out = g->out_keys + (b * T + t) * A;
                if (t < g->lengths[b]) {
                    scaled_row(A, y + i * A, scale[i], g->keys_bias, out, 0);
                    i++;
                } else {
                    memcpy(out, g->keys_bias, (size_t)A * sizeof(float));
                }
            }
        int64_t K = 4 * g->init.K4;
        for (int64_t b = first; b < last; b++)
            scale[b - first] = row_quantize(K, g->ann + b * T * C + g->offset, (uint8_t *)(u + (b - first) * g->init.K4),
                                            g->qmax, g->tiny, scaled);
        int8_product(&g->init, last - first, u, y, g->form);
        for (int64_t b = first; b < last; b++)
            scaled_row(S, y + (b - first) * S, scale[b - first], g->init_bias, g->out_init + b * S, 1);
    }
    free(u), free(scale), free(y), free(scaled);
}

enum { ARRAYS = 12 };
static const char *names[ARRAYS] = {"annotations", "lengths", "keys panels", "keys colsum", "keys mult", "keys bias",
                                    "init panels", "init colsum", "init mult", "init bias", "keys", "init_state"};
static const int ndims[ARRAYS] = {3, 1, 3, 1, 1, 1, 3, 1, 1, 1, 3, 2};
static const char fmts[ARRAYS] = {'f', 'q', 'i', 'i', 'f', 'f', 'i', 'i', 'f', 'f', 'f', 'f'};

/* product i's view (buffers b[2 + 4 i]: panels, colsum, mult, bias) of K4 quads into J columns, without its bias
 * (added after the row's scale), or a ValueError */
static int product_of(const Py_buffer *b, int i, int64_t K4, int64_t J, Product *p) {
    if (product_view(b + 2 + 4 * i, "encoder_rest", names[2 + 4 * i], K4, J, p) < 0) return -1;
    p->bias = NULL;
    return 0;
}

PyObject *py_encoder_rest(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *arrays;
    Rest g = {0};
    int threads = 1, form = -1;
    long long offset = 0;
    if (!PyArg_ParseTuple(args, "O(ff)L|ii", &arrays, &g.qmax, &g.tiny, &offset, &threads, &form)) return NULL;
    Py_buffer b[ARRAYS] = {{0}};
    int ok = get_buffers(arrays, b, ARRAYS, ndims, fmts, names, 10, NULL, "encoder_rest") == 0;
    if (ok && (g.form = product_form("encoder_rest", form)) < 0) ok = 0;
    PyObject *result = NULL;
    if (ok) {
        g.B = b[0].shape[0], g.T = b[0].shape[1], g.C = b[0].shape[2], g.offset = offset;
        int64_t A = b[10].shape[2], S = b[11].shape[1], K = 4 * b[6].shape[1];
        if (b[1].shape[0] != g.B || b[10].shape[0] != g.B || b[10].shape[1] != g.T || b[11].shape[0] != g.B ||
            g.C % LANES || K % LANES || A % LANES || S % LANES || offset < 0 || offset + K > g.C) {
            PyErr_SetString(PyExc_ValueError, "encoder_rest: shapes do not agree (annotations (B, T, C), lengths (B,), "
                            "keys (B, T, A), init_state (B, S), offset + init's inputs <= C; C, A, S and the init's "
                            "inputs multiples of 16)");
            ok = 0;
        }
        if (ok && (product_of(b, 0, g.C / 4, A, &g.keys) || product_of(b, 1, K / 4, S, &g.init))) ok = 0;
        for (int64_t r = 0; ok && r < g.B; r++)
            if (((const int64_t *)b[1].buf)[r] < 1 || ((const int64_t *)b[1].buf)[r] > g.T) {
                PyErr_Format(PyExc_ValueError, "encoder_rest: lengths holds %lld, not between 1 and T = %lld",
                             (long long)((const int64_t *)b[1].buf)[r], (long long)g.T);
                ok = 0;
            }
    }
    if (ok) {
        g.ann = b[0].buf, g.lengths = b[1].buf, g.out_keys = b[10].buf, g.out_init = b[11].buf;
        g.keys_bias = b[5].buf, g.init_bias = b[9].buf;
        result = run_rows_released(rest_rows, &g, g.B, g.lengths, g.T, threads, &g.failed);
    }
    release_buffers(b, ARRAYS);
    return result;
}
