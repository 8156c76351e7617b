/* The additive attention of one decoder step, fused: scores, mask, softmax and context in one pass.
 *
 * For each row r with source length L = lengths[r] (columns L.. are padding):
 *   energy[j] = v . tanh(query[r] + keys[r, j])            j < L
 *   alpha[r, j] = softmax(energy)[j] (j < L), 0 (j >= L)
 *   context[r] = sum_j alpha[r, j] annotations[r, j]
 * ONNX Runtime's CPU operators make three passes over rows x src_len x A floats for the scores (add,
 * tanh, v), score the padding, and read every padded annotation; this reads each real key and
 * annotation once (service/decoding/fused.py; measured in docs/speed-round2.md).
 *
 * With `slots`, row r reads its keys and annotations at slot slots[r] of arrays that hold a batch's rows
 * wherever they were written (service/decoding/layout.py: rows that leave free their slot, rows that
 * join take free ones, and no row is copied to keep the others contiguous).
 *
 * Each row is computed on its own, in the same order whatever the batch: the results of a row do not
 * depend on the other rows (batch invariance, tests/test_fused_attention.py). tanh is computed as
 * (1 - e) / (1 + e) with e = exp(-2|x|) (Cody-Waite reduction, degree-7 Taylor polynomial: absolute
 * error about 1e-7), on GCC's generic vectors of 16 floats; target_clones compiles the loop for
 * x86-64-v4 (AVX-512), v3 (AVX2 + FMA) and the baseline, chosen once at load for the CPU.
 */
#include <pthread.h>

#include "kernels.h"

/* rows [first, last); query rows lie `query_stride` floats apart (the first A columns of the step's
 * state product) */
CLONES
static void attend_rows(int64_t first, int64_t last, int64_t src_len, int64_t A, int64_t C, const float *query,
                        int64_t query_stride, const float *keys, const float *annotations, const int64_t *lengths,
                        const int64_t *slots, const float *v, float *alpha, float *context) {
    for (int64_t r = first; r < last; r++) {
        const float *q = query + r * query_stride;
        int64_t s = slots ? slots[r] : r; /* the row's place in keys and annotations */
        float *a = alpha + r * src_len;
        int64_t L = lengths[r] < src_len ? lengths[r] : src_len;
        float best = -INFINITY;
        for (int64_t j = 0; j < L; j++) {
            const float *k = keys + (s * src_len + j) * A;
            vf acc = splat(0.0f);
            for (int64_t d0 = 0; d0 < A; d0 += LANES) {
                vf qv, kv, vv;
                memcpy(&qv, q + d0, sizeof qv);
                memcpy(&kv, k + d0, sizeof kv);
                memcpy(&vv, v + d0, sizeof vv);
                acc += vv * tanh_v(qv + kv);
            }
            a[j] = hsum(acc);
            if (a[j] > best) best = a[j];
        }
        float sum = 0.0f;
        for (int64_t j = 0; j < L; j++) {
            a[j] = expf(a[j] - best);
            sum += a[j];
        }
        for (int64_t j = 0; j < L; j++) a[j] /= sum;
        for (int64_t j = L; j < src_len; j++) a[j] = 0.0f;
        float *c = context + r * C;
        for (int64_t i = 0; i < C; i++) c[i] = 0.0f;
        for (int64_t j = 0; j < L; j++) {
            const float *h = annotations + (s * src_len + j) * C;
            float w = a[j];
            for (int64_t i = 0; i < C; i++) c[i] += w * h[i];
        }
    }
}

typedef struct {
    int64_t src_len, A, C, query_stride;
    const float *query, *keys, *annotations, *v;
    const int64_t *lengths, *slots;
    float *alpha, *context;
} Attention;

static void attend_part(const void *ctx, int64_t first, int64_t last) {
    const Attention *p = ctx;
    attend_rows(first, last, p->src_len, p->A, p->C, p->query, p->query_stride, p->keys, p->annotations,
                p->lengths, p->slots, p->v, p->alpha, p->context);
}

#define MAX_THREADS 16
#define ROWS_PER_THREAD 8 /* fewer rows a thread than this: not worth starting one */

typedef struct {
    RowsFn fn;
    const void *ctx;
    int64_t first, last;
} Job;

static void *run_job(void *arg) {
    Job *job = arg;
    job->fn(job->ctx, job->first, job->last);
    return NULL;
}

void run_rows(RowsFn fn, const void *ctx, int64_t rows, const int64_t *weights, int64_t cap, int threads) {
    int64_t total = 0;
    for (int64_t r = 0; r < rows; r++) total += weights ? (weights[r] < cap ? weights[r] : cap) : 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > rows / ROWS_PER_THREAD) threads = (int)(rows / ROWS_PER_THREAD);
    if (threads < 2 || total == 0) {
        fn(ctx, 0, rows);
        return;
    }
    Job jobs[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    int64_t r = 0, done = 0;
    for (int t = 0; t < threads; t++) {
        jobs[t] = (Job){fn, ctx, r, r};
        int64_t goal = total * (t + 1) / threads;
        while (r < rows && (t == threads - 1 || done < goal)) {
            done += weights ? (weights[r] < cap ? weights[r] : cap) : 1;
            r++;
        }
        jobs[t].last = r;
    }
    for (int t = 1; t < threads; t++) started[t] = pthread_create(&ids[t], NULL, run_job, &jobs[t]) == 0;
    run_job(&jobs[0]);
    for (int t = 1; t < threads; t++) {
        if (started[t]) pthread_join(ids[t], NULL);
        else run_job(&jobs[t]);
    }
}

int get_buffer(PyObject *obj, Py_buffer *view, int ndim, char fmt, int writable, const char *name) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    int ok = PyObject_GetBuffer(obj, view, flags) == 0;
    if (ok) {
        const char *f = view->format ? view->format : "B";
        if (*f == '<' || *f == '=' || *f == '@') f++;
        ok = view->ndim == ndim && f[0] != 0 && f[1] == 0 && view->itemsize == (fmt == 'q' ? 8 : fmt == 'H' ? 2 : 4) &&
             (fmt == 'q' ? (f[0] == 'q' || f[0] == 'l') : f[0] == fmt);
        if (!ok) PyBuffer_Release(view);
    }
    if (!ok) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s: a C-contiguous %s array of %d dimensions was expected, got %R", name,
                     fmt == 'f' ? "float32" : fmt == 'i' ? "int32" : fmt == 'H' ? "float16" : "int64", ndim, (PyObject *)Py_TYPE(obj));
        return -1;
    }
    return 0;
}

PyObject *run_rows_released(RowsFn fn, const void *ctx, int64_t rows, const int64_t *weights, int64_t cap, int threads,
                            const int *failed) {
    Py_BEGIN_ALLOW_THREADS
    run_rows(fn, ctx, rows, weights, cap, threads);
    Py_END_ALLOW_THREADS
    return *failed ? PyErr_NoMemory() : Py_NewRef(Py_None);
}

int get_buffers(PyObject *arrays, Py_buffer *b, int n, const int *ndims, const char *fmts, const char *const *names,
                int outputs, int (*optional)(int i), const char *who) {
    PyObject *list = PySequence_Fast(arrays, "");
    if (!list) {
        PyErr_Format(PyExc_TypeError, "%s: arrays must be a sequence", who);
        return -1;
    }
    int ok = PySequence_Fast_GET_SIZE(list) == n;
    if (!ok) PyErr_Format(PyExc_ValueError, "%s: %d arrays expected", who, n);
    for (int i = 0; ok && i < n; i++) {
        PyObject *o = PySequence_Fast_GET_ITEM(list, i);
        if (o == Py_None && optional && optional(i)) continue;
        if (get_buffer(o, &b[i], ndims[i], fmts[i], i >= outputs, names[i]) < 0) ok = 0;
    }
    Py_DECREF(list); /* each view holds its array */
    return ok ? 0 : -1;
}

void release_buffers(Py_buffer *b, int n) {
    for (int i = 0; i < n; i++) PyBuffer_Release(&b[i]); /* an empty view (no obj): nothing */
}

static PyObject *py_attend(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *o[8] = {NULL};
    static const char *names[8] = {"product", "keys", "annotations", "lengths", "v", "alpha", "context", "slots"};
    static const int ndims[8] = {2, 3, 3, 1, 1, 2, 2, 1};
    static const char fmts[8] = {'f', 'f', 'f', 'q', 'f', 'f', 'f', 'q'};
    int threads = 1;
    if (!PyArg_ParseTuple(args, "OOOOOOO|iO", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &o[6], &threads, &o[7]))
        return NULL;
    int wanted = o[7] != NULL && o[7] != Py_None ? 8 : 7;
    Py_buffer b[8];
    int got = 0;
    for (; got < wanted; got++)
        if (get_buffer(o[got], &b[got], ndims[got], fmts[got], got == 5 || got == 6, names[got]) < 0) break;
    PyObject *result = NULL;
    if (got == wanted) {
        Py_ssize_t rows = b[3].shape[0], src_len = b[1].shape[1], A = b[4].shape[0], C = b[2].shape[2];
        Py_ssize_t places = b[1].shape[0]; /* rows, or the slots rows are read from */
        const int64_t *slots = wanted == 8 ? b[7].buf : NULL;
        int bad_slot = 0;
        if (slots) {
            bad_slot = b[7].shape[0] != rows;
            for (Py_ssize_t r = 0; r < rows && !bad_slot; r++) bad_slot = slots[r] < 0 || slots[r] >= places;
        }
        if (b[0].shape[0] != rows || b[0].shape[1] < A || (slots ? 0 : places != rows) || b[1].shape[2] != A ||
            b[2].shape[0] != places || b[2].shape[1] != src_len || b[5].shape[0] != rows ||
            b[5].shape[1] != src_len || b[6].shape[0] != rows || b[6].shape[1] != C || A % LANES != 0 || bad_slot) {
            PyErr_SetString(PyExc_ValueError, "attend: shapes do not agree (product (rows, >= A), keys (rows, "
                            "src_len, A), annotations (rows, src_len, C), lengths (rows,), v (A,) with A a "
                            "multiple of 16, alpha (rows, src_len), context (rows, C); with slots (rows,), keys "
                            "and annotations (places, ...) and every slot in [0, places))");
        } else {
            Attention job = {src_len, A, C, b[0].shape[1], b[0].buf, b[1].buf, b[2].buf, b[4].buf, b[3].buf,
                             slots, b[5].buf, b[6].buf};
            Py_BEGIN_ALLOW_THREADS
            run_rows(attend_part, &job, rows, b[3].buf, src_len, threads);
            Py_END_ALLOW_THREADS
            result = Py_NewRef(Py_None);
        }
    }
    for (int i = 0; i < got; i++) PyBuffer_Release(&b[i]);
    return result;
}

static PyMethodDef methods[] = {
    {"attend", py_attend, METH_VARARGS,
     "attend(product, keys, annotations, lengths, v, alpha, context, threads=1, slots=None): the step's additive "
     "attention, written into alpha (rows, src_len) and context (rows, C); the query is product[:, :A]. "
     "threads > 1: rows split between that many threads (at least 8 rows each); same results. slots (rows,): "
     "row r reads keys[slots[r]] and annotations[slots[r]] (arrays of any number of places)."},
    {"gru_encode", py_gru_encode, METH_VARARGS,
     "gru_encode(table, ids, lengths, weights, weights8, colsum, wscale, rbn, out, threads=1, form=-1): the encoder's "
     "bidirectional GRU with an int8 recurrence (service/decoding/encoder.c) into out (B, T, 2H); form: the "
     "products' instructions (0 plain C, 1 AVX2, 2 AVX-512 VNNI; -1 the best this CPU has), same results."},
    {"gru_form", py_gru_form, METH_NOARGS, "gru_form(): the instructions gru_encode's products use here."},
    {"output_layer", py_output_layer, METH_VARARGS,
     "output_layer(raw, scale, bias, values, ids, log_probs=None, threads=1): logits = raw * scale + bias "
     "(raw (rows, V), scale (rows, 1), bias (V,)); their k best log-probabilities, descending, into values "
     "(rows, k) and their ids into ids (rows, k) (ties: the lower id first); every log-probability into "
     "log_probs (rows, V) when given."},
    {"middle", py_middle, METH_VARARGS,
     "middle(arrays, (unit, qmax, tiny, inv_qmax), threads=1, form=-1): the int8 step's GRU cell, deep output and "
     "products from the context to the output layer's input (service/decoding/middle.c; arrays as "
     "service/decoding/fused_middle.py gives them); form: 0 plain C, 2 AVX-512 VNNI (-1 the best here), same results."},
    {"shortlist_layer", py_shortlist_layer, METH_VARARGS,
     "shortlist_layer(a, scale, w, wsum, wscale, bias, starts, counts, ids, values, out_ids, threads=1, form=-1): "
     "the output layer over each row's own candidates (service/decoding/shortlist_layer.c): row r's k best "
     "log-probabilities over ids[starts[r]:starts[r] + counts[r]] into values and out_ids (rows, k); form as "
     "gru_encode's, same results."},
    {"shortlist_words", py_shortlist_words, METH_VARARGS,
     "shortlist_words(offsets, ids, pieces, out): the union of the lists of the source pieces `pieces` (piece p's: "
     "ids[offsets[p]:offsets[p + 1]]; pieces without one bring nothing) into out, ascending; returns how many."},
    {"encoder_rest", py_encoder_rest, METH_VARARGS,
     "encoder_rest(arrays, (qmax, tiny), offset, threads=1, form=-1): the int8 encoder's keys and initial state from "
     "its annotations (service/decoding/encoder_rest.c; arrays as service/decoding/fused_encoder.py gives them)."},
    {"state_product", py_state_product, METH_VARARGS,
     "state_product((state, panels, colsum, mult, bias, out), unit, threads=1, form=-1): the fused step's query graph, "
     "out (rows, J) = the int8 product of q(state) (service/decoding/query.c; the product's arrays as "
     "service/decoding/fused_middle.py gives them); form as middle's, same results."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_attention", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__attention(void) { return PyModule_Create(&module); }
