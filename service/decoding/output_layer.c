/* The int8 step's output layer after its product, fused: bias, log-softmax and top-k in two passes.
 *
 * The graph's tail (export/graphs/int8_step.py) is logits = raw * scale + bias (raw: the output
 * product, rows x V; scale: each row's dequantization factor), LogSoftmax over V, then a blocked
 * top-k (ReduceMax, two TopK, GatherND, ...): ONNX Runtime makes six or more passes over rows x V.
 * Here, per row: the largest logit (pass 1), then the sum of exp(logit - max) and the k largest
 * logits (pass 2, a logit entering the k best only when above the k-th so far: ties keep the lower
 * id, as ONNX Runtime's TopK does); log-probability = logit - (max + log(sum)). Rows are computed on
 * their own, in the same order whatever the batch (service/decoding/fused.py).
 */
#include "kernels.h"

typedef struct {
    int64_t V, k;
    const float *raw, *scale, *bias;
    float *values, *log_probs;
    int64_t *ids;
} Output;

static inline __attribute__((always_inline)) vf logits_at(const float *raw, const float *bias, int64_t v0, float s) {
    vf x, b;
    memcpy(&x, raw + v0, sizeof x);
    memcpy(&b, bias + v0, sizeof b);
    return x * s + b;
}

CLONES
static void output_rows(const void *ctx, int64_t first, int64_t last) {
    const Output *p = ctx;
    int64_t V = p->V, k = p->k, body = V / LANES * LANES;
    for (int64_t r = first; r < last; r++) {
        const float *raw = p->raw + r * V;
        float s = p->scale[r];
        vf top = splat(-INFINITY);
        for (int64_t v0 = 0; v0 < body; v0 += LANES) {
            vf x = logits_at(raw, p->bias, v0, s);
            top = select_v(x > top, x, top);
        }
        float m = -INFINITY, lane[LANES];
        memcpy(lane, &top, sizeof lane);
        for (int l = 0; l < LANES; l++) m = lane[l] > m ? lane[l] : m;
        for (int64_t v = body; v < V; v++) m = fmaxf(m, raw[v] * s + p->bias[v]);
        float best[MAX_K];
        int64_t *ids = p->ids + r * k, have = 0;
        vf sums = splat(0.0f);
        for (int64_t v0 = 0; v0 < body; v0 += LANES) {
            vf x = logits_at(raw, p->bias, v0, s);
            sums += exp_v(x - m);
            if (any(x > (have == k ? best[k - 1] : -INFINITY))) {
                float xs[LANES];
                memcpy(xs, &x, sizeof xs);
                for (int l = 0; l < LANES; l++) offer(best, ids, &have, k, xs[l], v0 + l);
            }
        }
        float sum = hsum(sums);
        for (int64_t v = body; v < V; v++) {
            float x = raw[v] * s + p->bias[v];
            vf e = exp_v(splat(x - m));
            sum += e[0];
            offer(best, ids, &have, k, x, v);
        }
        float lse = m + logf(sum);
        for (int64_t j = 0; j < k; j++) p->values[r * k + j] = best[j] - lse;
        if (p->log_probs) {
            float *out = p->log_probs + r * V;
            for (int64_t v0 = 0; v0 < body; v0 += LANES) {
                vf x = logits_at(raw, p->bias, v0, s) - lse;
                memcpy(out + v0, &x, sizeof x);
            }
            for (int64_t v = body; v < V; v++) out[v] = (raw[v] * s + p->bias[v]) - lse;
        }
    }
}

PyObject *py_output_layer(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *o[6] = {NULL, NULL, NULL, NULL, NULL, Py_None};
    static const char *names[6] = {"raw", "scale", "bias", "values", "ids", "log_probs"};
    static const int ndims[6] = {2, 2, 1, 2, 2, 2};
    static const char fmts[6] = {'f', 'f', 'f', 'f', 'q', 'f'};
    int threads = 1;
    if (!PyArg_ParseTuple(args, "OOOOO|Oi", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &threads)) return NULL;
    int n = o[5] == Py_None ? 5 : 6;
    Py_buffer b[6];
    int got = 0;
    for (; got < n; got++)
        if (get_buffer(o[got], &b[got], ndims[got], fmts[got], got >= 3, names[got]) < 0) break;
    PyObject *result = NULL;
    if (got == n) {
        Py_ssize_t rows = b[0].shape[0], V = b[0].shape[1], k = b[3].shape[1];
        if (b[1].shape[0] != rows || b[1].shape[1] != 1 || b[2].shape[0] != V || b[3].shape[0] != rows ||
            b[4].shape[0] != rows || b[4].shape[1] != k || k < 1 || k > V || k > MAX_K ||
            (n == 6 && (b[5].shape[0] != rows || b[5].shape[1] != V))) {
            PyErr_Format(PyExc_ValueError, "output_layer: shapes do not agree (raw (rows, V), scale (rows, 1), "
                         "bias (V,), values and ids (rows, k) with 1 <= k <= min(V, %d), log_probs (rows, V))",
                         MAX_K);
        } else {
            Output job = {V, k, b[0].buf, b[1].buf, b[2].buf, b[3].buf, n == 6 ? b[5].buf : NULL, b[4].buf};
            Py_BEGIN_ALLOW_THREADS
            run_rows(output_rows, &job, rows, NULL, 0, threads);
            Py_END_ALLOW_THREADS
            result = Py_NewRef(Py_None);
        }
    }
    for (int i = 0; i < got; i++) PyBuffer_Release(&b[i]);
    return result;
}
